"""Hot-row cache of a TT embedding table: its most frequent rows kept as a small dense table."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from comera_compile.planner.gathered import interleave

DEFAULT_WARMUP = 100
"""Training forward passes whose ids are counted before the cached set is fixed."""

EMPTY = -1
"""``cache_ids`` value of a slot that holds no row (empty slots sort first)."""


def split_by_cache(cache_ids: Tensor, ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(slots of the hits, positions of the hits, positions of the misses)`` in ``ids``."""
    slot = torch.searchsorted(cache_ids, ids).clamp_(max=cache_ids.numel() - 1)
    hit = cache_ids.index_select(0, slot) == ids
    hits = hit.nonzero().squeeze(1)
    misses = (~hit).nonzero().squeeze(1)
    return slot.index_select(0, hits), hits, misses


def top_rows(ids: Tensor, counts: Tensor | None, capacity: int) -> Tensor:
    """The at most ``capacity`` most counted distinct ids, sorted (ties: the smaller id)."""
    ids = ids.reshape(-1).long()
    weights = torch.ones_like(ids) if counts is None else counts.reshape(-1).long()
    if weights.numel() != ids.numel():
        raise ValueError(f"counts has {weights.numel()} entries for {ids.numel()} ids")
    distinct, inverse = torch.unique(ids, return_inverse=True)  # sorted
    totals = torch.zeros_like(distinct).index_add_(0, inverse, weights)
    keep = min(int(capacity), distinct.numel())
    # stable descending sort: equal counts keep ascending id order
    order = torch.sort(totals, descending=True, stable=True).indices[:keep]
    return distinct.index_select(0, order).sort().values


class Interleave(torch.autograd.Function):
    """``first`` rows at positions ``at_first`` and ``second`` rows at ``at_second`` of one
    output (positions that partition it), as one node: a cached table's hits and misses put
    back in their ids' order without a concatenation and a permutation (and their
    backwards)."""

    @staticmethod
    def forward(ctx, first: Tensor, at_first: Tensor, second: Tensor,
                at_second: Tensor) -> Tensor:
        ctx.save_for_backward(at_first, at_second)
        ctx.first_dtype = first.dtype
        return interleave(first, at_first, second, at_second)

    @staticmethod
    def backward(ctx, grad: Tensor):
        at_first, at_second = ctx.saved_tensors
        return (grad.index_select(0, at_first).to(ctx.first_dtype), None,
                grad.index_select(0, at_second), None)


class RowCache(nn.Embedding):
    """The cached rows (``weight``) and the ids they hold (``ids``, sorted, ``EMPTY`` first)."""

    def __init__(self, rows: int, dim: int, sparse: bool, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__(rows, dim, sparse=sparse, dtype=dtype, device=device)
        nn.init.zeros_(self.weight)
        self.register_buffer("ids", torch.full((rows,), EMPTY, dtype=torch.long, device=device))


class IdTally:
    """Counts of the ids seen so far (distinct ids and their counts, no table-sized array)."""

    def __init__(self) -> None:
        self.ids: Tensor | None = None
        self.counts: Tensor | None = None
        self.calls = 0

    def add(self, ids: Tensor, counts: Tensor | None = None) -> None:
        ids = ids.detach().reshape(-1).long()
        counts = torch.ones_like(ids) if counts is None else counts.reshape(-1).long()
        if self.ids is not None:
            ids, counts = torch.cat([self.ids, ids]), torch.cat([self.counts, counts])
        self.ids, inverse = torch.unique(ids, return_inverse=True)
        self.counts = torch.zeros_like(self.ids).index_add_(0, inverse, counts)
        self.calls += 1

    def clear(self) -> None:
        self.ids = self.counts = None
        self.calls = 0
