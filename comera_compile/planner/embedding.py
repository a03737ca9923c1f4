"""TT-embedding lookup plan: which bond to split the TTM chain at, and what it costs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from torch import Tensor

from .lookup import CHAIN, run_lookup
from .network import next_power_of_two
from .networks import _positive, internal_ranks
from .protocol import RowCost


def _left_merge_macs(m: Sequence[int], n: Sequence[int], r: Sequence[int]) -> int:
    """Cores ``0..len(m)-1`` merged left to right; ``r`` are the full ranks from r_0."""
    total, big_m, big_n = 0, m[0], n[0]
    for k in range(1, len(m)):
        total += big_m * big_n * r[k] * m[k] * n[k] * r[k + 1]
        big_m, big_n = big_m * m[k], big_n * n[k]
    return total


def _right_merge_macs(m: Sequence[int], n: Sequence[int], r: Sequence[int]) -> int:
    """Cores merged right to left; ``r`` are the full ranks of this half (r[-1] == 1)."""
    total, big_m, big_n = 0, m[-1], n[-1]
    for k in range(len(m) - 2, -1, -1):
        total += r[k] * m[k] * n[k] * r[k + 1] * big_m * big_n
        big_m, big_n = big_m * m[k], big_n * n[k]
    return total


@dataclass(frozen=True)
class EmbeddingPlan:
    """The chosen split of a TT-embedding lookup and what it costs for ``rows_bucket`` ids."""

    row_modes: tuple[int, ...]
    col_modes: tuple[int, ...]
    ranks: tuple[int, ...]  # full, [1, r_1, ..., r_{d-1}, 1]
    rows_bucket: int
    split: int  # 0 when d == 1 (plain gather), CHAIN for per-core gathers, else the bond
    merge_macs: int
    macs: int
    peak: int
    kind: str = "tt_embedding"
    objective: str = "macs"
    optimizer = "comera.split_search"  # what chose the split (a class constant, not a field)

    @property
    def cost(self) -> float:
        return self.macs

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f"G{k + 1}" for k in range(len(self.row_modes)))

    @property
    def halves(self) -> tuple[int, int, int, int, int]:
        """``(M_L, N_L, r_s, M_R, N_R)`` of the split."""
        s, m, n = self.split, self.row_modes, self.col_modes
        return (math.prod(m[:s]), math.prod(n[:s]), self.ranks[s], math.prod(m[s:]),
                math.prod(n[s:]))

    @property
    def equation(self) -> str:
        """The per-row contraction after the gathers (a description)."""
        if self.split == CHAIN:
            return "bnr,brms->bnms (per core)"
        return "gather" if self.split == 0 else "bpr,brq->bpq"

    @property
    def sizes(self) -> dict[str, int]:
        if self.split == CHAIN:
            return {"b": self.rows_bucket, "n": math.prod(self.col_modes), "r": max(self.ranks)}
        if self.split == 0:
            return {"b": self.rows_bucket, "m": self.row_modes[0], "n": self.col_modes[0]}
        _, n_left, rank, _, n_right = self.halves
        return {"b": self.rows_bucket, "p": n_left, "q": n_right, "r": rank}

    @property
    def path(self) -> list[tuple[int, int]]:
        if self.split == CHAIN:  # ((g1 . g2) . g3) ... over the gathered slices
            return [(0, 1)] + [(k, len(self.names) + k - 2) for k in range(2, len(self.names))]
        return [] if self.split == 0 else [(0, 1)]

    def order_expression(self) -> str:
        names = self.names
        if self.split == CHAIN:
            expr = f"gather({names[0]})"
            for name in names[1:]:
                expr = (
                    f"({expr} . gather({name}))"
                    if name != names[-1]
                    else f"{expr} . gather({name})"
                )
            return expr
        if self.split == 0:
            return f"gather({names[0]})"
        left, right = " . ".join(names[: self.split]), " . ".join(names[self.split :])
        return f"gather({left}) . gather({right})"

    def cost_at(self, rows: int) -> RowCost:
        """Macs and peak of this split for exactly ``rows`` ids (the objective is macs)."""
        rows = int(rows)
        if self.split == 0:
            macs, peak = 0, max(self.row_modes[0] * self.col_modes[0], rows * self.col_modes[0])
        elif self.split == CHAIN:
            macs, peak = chain_costs(self.row_modes, self.col_modes, self.ranks, rows)
        else:
            costs = split_costs(self.row_modes, self.col_modes, self.ranks, rows)
            macs, _, peak = costs[self.split]
        return RowCost(macs, peak, macs, {**self.sizes, "b": rows})

    def execute(self, ids: Tensor, *cores: Tensor) -> Tensor:
        """The execution side of the plan protocol: :meth:`lookup` of ``ids``."""
        return run_lookup(self, ids, cores)

    def lookup(self, ids: Tensor, cores: Sequence[Tensor],
               gates: Sequence[Tensor] | None = None,
               sparse: bool | Sequence[bool] = False) -> Tensor:
        """Rows ``(len(ids), prod(col_modes))`` of the table for 1-d ``ids`` from slices-first
        ``cores``, run by :func:`~comera_compile.planner.lookup.run_lookup` (``gates`` weight
        the internal bonds; ``sparse``: the cores' gradients are sparse, all or per core)."""
        return run_lookup(self, ids, cores, gates, sparse)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "row_modes": list(self.row_modes),
                "col_modes": list(self.col_modes), "ranks": list(self.ranks),
                "rows_bucket": self.rows_bucket, "split": self.split, "merge_macs": self.merge_macs,
                "macs": self.macs, "peak": self.peak, "objective": self.objective,
                "order": self.order_expression()}


def chain_costs(row_modes: Sequence[int], col_modes: Sequence[int], ranks: Sequence[int],
                rows: int) -> tuple[int, int]:
    """``(macs, peak)`` of the per-core gather + per-row chain strategy."""
    n, r = col_modes, ranks
    macs, width, peak = 0, n[0], rows * n[0] * r[1]
    for k in range(1, len(n)):
        macs += rows * width * r[k] * n[k] * r[k + 1]
        width *= n[k]
        peak = max(peak, rows * r[k] * n[k] * r[k + 1], rows * width * r[k + 1])
    return macs, peak


def split_costs(row_modes: Sequence[int], col_modes: Sequence[int], ranks: Sequence[int],
                rows: int) -> dict[int, tuple[int, int, int]]:
    """``{split: (total macs, merge macs, peak)}`` for every split bond (full ranks)."""
    m, n, r = row_modes, col_modes, ranks
    d = len(m)
    out = {}
    for s in range(1, d):
        merge = _left_merge_macs(m[:s], n[:s], r[: s + 1]) + _right_merge_macs(m[s:], n[s:], r[s:])
        m_l, n_l, m_r, n_r = math.prod(m[:s]), math.prod(n[:s]), math.prod(m[s:]), math.prod(n[s:])
        total = merge + rows * n_l * r[s] * n_r
        peak = max(
            m_l * n_l * r[s], m_r * r[s] * n_r, rows * r[s] * max(n_l, n_r), rows * n_l * n_r
        )
        out[s] = (total, merge, peak)
    return out


@lru_cache(maxsize=1024)
def _embedding_plan(row_modes, col_modes, ranks, bucket) -> EmbeddingPlan:
    d = len(row_modes)
    if d == 1:
        size = row_modes[0] * col_modes[0]
        return EmbeddingPlan(
            row_modes, col_modes, ranks, bucket, 0, 0, 0, max(size, bucket * col_modes[0])
        )
    costs = split_costs(row_modes, col_modes, ranks, bucket)
    chain_macs, chain_peak = chain_costs(row_modes, col_modes, ranks, bucket)
    costs[CHAIN] = (chain_macs, 0, chain_peak)
    split = min(costs, key=lambda s: (costs[s][0], s != CHAIN, s))
    total, merge, peak = costs[split]
    return EmbeddingPlan(row_modes, col_modes, ranks, bucket, split, merge, total, peak)


def embedding_plan(row_modes: Sequence[int], col_modes: Sequence[int], ranks: int | Sequence[int],
                   rows: int) -> EmbeddingPlan:
    """The cheapest split for ``rows`` ids (bucketed to a power of two, cached)."""
    m = _positive("row_modes", row_modes)
    n = _positive("col_modes", col_modes)
    if len(m) != len(n):
        raise ValueError(f"TTM needs as many row modes as col modes, got {list(m)} / {list(n)}")
    full = (1, *internal_ranks(ranks, len(m)), 1)
    return _embedding_plan(m, n, full, next_power_of_two(rows))
