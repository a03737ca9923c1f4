"""TTEmbedding: an embedding table (or bag) stored as a TTM chain, looked up without the table.

Cores are ``(r_{k-1}, m_k, n_k, r_k)`` with ``m`` the vocabulary modes and ``n`` the
embedding-dim modes. A lookup splits each id into mode indices, gathers only the needed
slices of two pre-merged halves of the chain and contracts them per row (the planner picks
the split for the number of ids). Ids are de-duplicated first so each distinct row is built
once, then scattered back; bags are pooled by ``F.embedding_bag`` on those rows (fixed-size
sum/mean bags by a gather and a sum, whose backward is cheaper). Nothing in
the forward or backward is table-sized: the work and the gradients scale with the distinct
ids of the batch and with the cores.

Recommenders declare their tables ``sparse=True`` so that only the touched rows get a
gradient. A TT table needs no such thing: its gradient is the cores' gradient, small and
dense, which SGD, Adagrad and Adam take as they are. ``torch.optim.SparseAdam`` only takes
sparse gradients, so it gets an error that says to use one of those instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from comera_compile.formats import (
    chain_layout,
    internal_ranks,
    is_lowrank_table,
    lookup_fan_ins,
    ttm_random_cores,
    ttm_svd,
    ttm_to_dense,
    zero_pad,
)
from comera_compile.formats.whiten import TABLE_DAMPING, weighted_lowrank_table
from comera_compile.nn.base import TensorizedLayer
from comera_compile.nn.gates import DEFAULT_THRESHOLD, hard_threshold
from comera_compile.planner import EmbeddingPlan, embedding_plan, host_reads_allowed
from comera_compile.planner.ops import planned_lookup

_BAG_MODES = (None, "sum", "mean", "max")


class TTEmbedding(TensorizedLayer):
    """``nn.Embedding`` (or, with ``mode=``, ``nn.EmbeddingBag``) replacement in TTM format.

    The name says TT (tensor train); the layout is TTM (tensor-train *matrix*): the
    ``(num_embeddings, embedding_dim)`` table is one chain of cores
    ``(r_{k-1}, row_modes[k], col_modes[k], r_k)``, one per (vocabulary mode, dim mode)
    pair, as in TT-Rec and CoMERA. It is not the TT-linear layout of ``TTLinear``.

    ``sparse=True`` is accepted so that a recommender's table swaps in unchanged; the cores'
    gradients are dense either way (``declared_sparse`` remembers what the table asked for).
    """

    format = "tt_embedding"

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        ranks: int | Sequence[int] = 32,
        padding_idx: int | None = None,
        mode: str | None = None,
        row_modes: Sequence[int] | None = None,
        col_modes: Sequence[int] | None = None,
        order: int | None = None,
        dedup: bool = True,
        include_last_offset: bool = False,
        sparse: bool = False,
        threshold: float = DEFAULT_THRESHOLD,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        chain = chain_layout(
            self.format, num_embeddings, embedding_dim, ranks, row_modes, col_modes, order
        )
        num_embeddings, embedding_dim = int(num_embeddings), int(embedding_dim)  # checked
        if mode not in _BAG_MODES:
            raise ValueError(f"mode must be one of {_BAG_MODES}, got {mode!r}")
        if include_last_offset and mode is None:
            raise ValueError("include_last_offset needs a bag layer (mode='sum'|'mean'|'max')")
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"padding_idx {padding_idx} is outside [0, {num_embeddings})")
            padding_idx %= num_embeddings
        # nn.Embedding draws N(0, 1): unit variance per entry.
        cores = ttm_random_cores(chain.first, chain.second, chain.ranks, 1.0, dtype, device)
        super().__init__(cores, threshold)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.row_modes, self.col_modes = chain.first, chain.second
        self.padding_idx, self.mode, self.dedup = padding_idx, mode, dedup
        self.include_last_offset, self.declared_sparse = bool(include_last_offset), bool(sparse)
        _watch_sparse_adam()

    @property
    def dense_parameters(self) -> int:
        return self.num_embeddings * self.embedding_dim

    @property
    def dense_fan_in(self) -> int:
        """A lookup sums nothing: a dense table's row is read as it is."""
        return 1

    def core_fan_ins(self) -> list[int]:
        """A gathered core sums only its left bond (``formats.scaling``)."""
        return lookup_fan_ins(self.ranks)

    def layout(self) -> dict:
        return {
            **super().layout(),
            "num_embeddings": self.num_embeddings,
            "embedding_dim": self.embedding_dim,
            "row_modes": list(self.row_modes),
            "col_modes": list(self.col_modes),
        }

    def _new_plan(self, bucket: int, dtype: torch.dtype, device_type: str) -> EmbeddingPlan:
        """Which bond to split the chain at for ``bucket`` ids (dtype-independent)."""
        return embedding_plan(self.row_modes, self.col_modes, self.ranks, bucket)

    def dense_macs(self, rows: int) -> int:
        return rows * self.embedding_dim  # the dense baseline copies one row per id

    def lookup(self, ids: Tensor) -> Tensor:
        """Rows ``(len(ids), embedding_dim)`` for a 1-d id tensor, without the table."""
        if torch.compiler.is_compiling():  # one op: planning stays out of the graph
            rows = planned_lookup(ids, self.gated_cores(), self.row_modes, self.col_modes)
            return rows[:, : self.embedding_dim]
        gates = [hard_threshold(g, self.threshold) for g in self.gates]
        rows = self.plan_for(ids.numel()).lookup(ids, list(self.cores), gates)
        return rows[:, : self.embedding_dim]

    def forward(
        self,
        input: Tensor,
        offsets: Tensor | None = None,
        per_sample_weights: Tensor | None = None,
    ) -> Tensor:
        """Rows like ``nn.Embedding``, or pooled bags like ``nn.EmbeddingBag`` (2-d ``input``
        of fixed-size bags, or 1-d ``input`` with ``offsets``)."""
        if input.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"TTEmbedding expects integer ids, got {input.dtype}")
        if self.mode is None and (offsets is not None or per_sample_weights is not None):
            raise ValueError("offsets / per_sample_weights need a bag layer (mode='sum'|'mean')")
        flat = input.reshape(-1).long()
        eager = host_reads_allowed()
        self._check_ids(flat, eager)
        if self.dedup and eager:
            ids, index = torch.unique(flat, return_inverse=True)
        elif self.dedup and isinstance(flat.numel(), int) and self.num_embeddings <= flat.numel():
            # compiled (no host read for unique): fewer rows than ids, so each row once
            # costs less than each id's row, and backward adds into the table's rows rather
            # than scattering every id's gradient into the few rows of the first core
            ids, index = torch.arange(self.num_embeddings, device=flat.device), flat
        else:
            ids, index = flat, None  # each id's own row, in order
        table = self.lookup(ids).to(self.cores[0].dtype)  # as nn.Embedding, even in autocast
        if index is None:
            if self.mode is None:
                # the rows are the output: no gather, and no index of the ids' count, whose
                # size a compiled backward with a dynamic batch could not bind (HF T5)
                if self.padding_idx is not None:  # padding reads zeros, passes no gradient
                    table = table.masked_fill((flat == self.padding_idx).unsqueeze(-1), 0)
                return table.reshape(*input.shape, self.embedding_dim)
            index = torch.arange(flat.numel(), device=flat.device)  # bags gather in order
        padding = None
        if self.padding_idx is not None:  # point padding positions at an extra zero row
            padding = table.shape[0]
            table = torch.cat([table, table.new_zeros(1, self.embedding_dim)])
            index = torch.where(flat == self.padding_idx, padding, index)
        if self.mode is None:
            return F.embedding(index, table).reshape(*input.shape, self.embedding_dim)
        if self._plain_bags(input, offsets, per_sample_weights, padding):
            return self._pool_fixed_bags(index, table, input.shape)
        return F.embedding_bag(
            index.reshape(input.shape),
            table,
            offsets,
            mode=self.mode,
            per_sample_weights=per_sample_weights,
            include_last_offset=self.include_last_offset,
            padding_idx=padding,
        )

    def _plain_bags(
        self, input: Tensor, offsets: Tensor | None, weights: Tensor | None, padding: int | None
    ) -> bool:
        """Fixed-size bags summed or averaged, nothing masked or weighted."""
        return (input.dim() == 2 and offsets is None and weights is None and padding is None
                and self.mode in ("sum", "mean"))

    def _pool_fixed_bags(self, index: Tensor, table: Tensor, shape: torch.Size) -> Tensor:
        """``(bags, ids per bag)`` pooled by a gather and a sum: the gather's backward is an
        ``index_add``, several times cheaper on CPU than ``embedding_bag``'s sorting backward
        (most recommender bags hold one id)."""
        rows = table.index_select(0, index).view(*shape, self.embedding_dim)
        if shape[1] == 1:
            return rows[:, 0]
        return rows.sum(1) if self.mode == "sum" else rows.mean(1)

    def _check_ids(self, flat: Tensor, eager: bool) -> None:
        """Out-of-range ids would silently read padding rows of the TTM chain: refuse them.

        Eagerly one host read gives both bounds for the message; while compiled (or under
        CUDA Graph capture) one fused device-side assert checks them without a sync.
        """
        if not flat.numel():
            return
        if not eager:
            inside = torch.logical_and(flat >= 0, flat < self.num_embeddings).all()
            torch._assert_async(inside, f"TTEmbedding ids must lie in [0, {self.num_embeddings})")
            return
        low, high = (int(v) for v in torch.stack(torch.aminmax(flat)).tolist())
        if low < 0 or high >= self.num_embeddings:
            raise IndexError(f"ids must lie in [0, {self.num_embeddings}), got [{low}, {high}]")

    def to_dense(self) -> Tensor:
        """The ``(num_embeddings, embedding_dim)`` table (for export and tests only)."""
        full = ttm_to_dense(self.gated_cores(), self.row_modes, self.col_modes)
        table = full[: self.num_embeddings, : self.embedding_dim]
        if self.padding_idx is not None:
            table = table.clone()
            table[self.padding_idx] = 0
        return table

    @classmethod
    def from_dense(
        cls,
        module: nn.Embedding | nn.EmbeddingBag,
        ranks: int | Sequence[int] | None = None,
        tolerance: float | None = None,
        row_frequencies: Tensor | None = None,
        **kwargs,
    ) -> TTEmbedding:
        """TTM-SVD of an embedding table (full rank when neither ``ranks`` nor ``tolerance``).

        ``row_frequencies`` (how often each row is looked up, e.g. counted on example
        batches) makes the truncation keep what lookups at those frequencies see
        (``formats.whiten``); it needs the low-rank layout (``lowrank_table_modes``).
        """
        layer = cls(
            module.num_embeddings,
            module.embedding_dim,
            ranks=1,
            device=module.weight.device,
            dtype=module.weight.dtype,
            **{**dense_options(module), **kwargs},
        )
        rows, cols = layer.padded_shape
        table = zero_pad(module.weight.detach(), rows, cols)
        if row_frequencies is None:
            cores = ttm_svd(
                table, layer.row_modes, layer.col_modes, max_rank=ranks, tolerance=tolerance
            )
        else:
            if tolerance is not None:
                raise ValueError("row_frequencies take ranks=, not tolerance=")
            cores = weighted_lowrank_cores(layer, table, row_frequencies, ranks)
        layer._set_cores(cores)
        return layer

    @property
    def padded_shape(self) -> tuple[int, int]:
        return math.prod(self.row_modes), math.prod(self.col_modes)

    def extra_repr(self) -> str:
        bag = f", mode={self.mode!r}" if self.mode else ""
        return f"{self.num_embeddings}, {self.embedding_dim}{bag}, {super().extra_repr()}"


def weighted_lowrank_cores(layer: TTEmbedding, table: Tensor, frequencies: Tensor,
                           ranks: int | Sequence[int] | None,
                           damping: float = TABLE_DAMPING) -> list[Tensor]:
    """Cores for ``layer`` (the low-rank layout) of the rank-``ranks`` table closest to
    ``table`` with rows weighed by their lookup ``frequencies`` (``formats.whiten``)."""
    if not is_lowrank_table(layer.row_modes, layer.col_modes):
        raise ValueError(
            f"row_frequencies need the low-rank table layout, row_modes ({layer.num_embeddings}, "
            f"1) and col_modes (1, {layer.embedding_dim}); got {list(layer.row_modes)} and "
            f"{list(layer.col_modes)}"
        )
    if frequencies.numel() != table.shape[0]:
        raise ValueError(f"row_frequencies has {frequencies.numel()} entries for a table of "
                         f"{table.shape[0]} rows")
    rank = min(table.shape) if ranks is None else internal_ranks(ranks, 2)[0]
    left, right = weighted_lowrank_table(table, frequencies.to(table.device), rank, damping)
    r = left.shape[1]
    return [left.reshape(1, table.shape[0], 1, r), right.reshape(r, 1, table.shape[1], 1)]


def dense_options(module: nn.Embedding | nn.EmbeddingBag) -> dict:
    """The settings of a dense table that its TT replacement keeps (keyword arguments)."""
    bag = isinstance(module, nn.EmbeddingBag)
    return {
        "padding_idx": module.padding_idx,
        "mode": module.mode if bag else None,
        "include_last_offset": bool(bag and module.include_last_offset),
        "sparse": bool(module.sparse),
    }


_sparse_adam_watched = False


def _watch_sparse_adam() -> None:
    """Once per process: make SparseAdam explain what to do with dense (TT core) gradients."""
    global _sparse_adam_watched
    if not _sparse_adam_watched:
        register_optimizer_step_pre_hook(_refuse_dense_grads_in_sparse_adam)
        _sparse_adam_watched = True


def _refuse_dense_grads_in_sparse_adam(optimizer, args, kwargs) -> None:
    """SparseAdam would fail on a dense gradient anyway; this says why and what to use."""
    if not isinstance(optimizer, torch.optim.SparseAdam):
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is not None and not param.grad.is_sparse:
                raise RuntimeError(
                    "torch.optim.SparseAdam only takes sparse gradients, but a parameter of "
                    f"shape {tuple(param.shape)} has a dense one. Tensorized embedding tables "
                    "(TTEmbedding, which replaces nn.Embedding/EmbeddingBag(sparse=True)) "
                    "train small TT cores whose gradients are dense: optimize them with "
                    "torch.optim.Adam, Adagrad or SGD instead of SparseAdam, e.g. "
                    "torch.optim.Adam(model.parameters())."
                )
