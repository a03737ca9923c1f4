"""TT-embedding lookup plan: split the TTM chain at one bond, never build the table.

``cores[:s]`` merge into a left table ``(M_L, N_L, r_s)`` and ``cores[s:]`` into a right
table ``(M_R, r_s, N_R)``; a row id splits into ``id // M_R`` and ``id % M_R``, each
gathers one slice, and one bmm per batch gives ``(N_L, N_R)`` per row. The merges cost
the same for every batch while the bmm grows with it, so the best split bond depends on
the number of ids: we pick the one with the fewest total multiply-adds. For a handful of
ids no merge pays off: ``split = CHAIN`` contracts the chain per row, one core at a time
(cost linear in the ids, nothing shared). Eagerly the rows meet each core in buckets of
equal mode index, one bmm over the core's slices, so a slice is read once per batch; while
compiled (no host reads) each row gathers its own slices.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from torch import Tensor

from .network import next_power_of_two
from .networks import _positive, internal_ranks
from .protocol import RowCost

CHAIN = -1
"""``EmbeddingPlan.split`` value for the per-core gather + per-row chain strategy."""


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
        return (
            math.prod(m[:s]),
            math.prod(n[:s]),
            self.ranks[s],
            math.prod(m[s:]),
            math.prod(n[s:]),
        )

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
        return self.lookup(ids, cores)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "row_modes": list(self.row_modes),
            "col_modes": list(self.col_modes),
            "ranks": list(self.ranks),
            "rows_bucket": self.rows_bucket,
            "split": self.split,
            "merge_macs": self.merge_macs,
            "macs": self.macs,
            "peak": self.peak,
            "objective": self.objective,
            "order": self.order_expression(),
        }

    def tables(self, cores: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        """Left ``(M_L, N_L * r_s)`` and right ``(M_R, r_s * N_R)`` tables (gather-ready)."""
        m, n, r, s = self.row_modes, self.col_modes, self.ranks, self.split
        left = cores[0].reshape(m[0], n[0], r[1])
        for k in range(1, s):
            big_m, big_n = left.shape[0], left.shape[1]
            t = torch.tensordot(left, cores[k], dims=([2], [0]))  # (M, N, m, n, r')
            left = t.permute(0, 2, 1, 3, 4).reshape(big_m * m[k], big_n * n[k], r[k + 1])
        d = len(m)
        right = cores[d - 1].reshape(r[d - 1], m[d - 1], n[d - 1])
        for k in range(d - 2, s - 1, -1):
            big_m, big_n = right.shape[1], right.shape[2]
            t = torch.tensordot(cores[k], right, dims=([3], [0]))  # (r, m, n, M, N)
            right = t.permute(0, 1, 3, 2, 4).reshape(r[k], m[k] * big_m, n[k] * big_n)
        m_left, n_left, rank, m_right, n_right = self.halves
        left = left.reshape(m_left, n_left * rank)
        right = right.permute(1, 0, 2).reshape(m_right, rank * n_right)
        return left, right

    def lookup(
        self, ids: Tensor, cores: Sequence[Tensor], gates: Sequence[Tensor] | None = None
    ) -> Tensor:
        """Rows ``(len(ids), prod(col_modes))`` of the TTM table for 1-d ``ids``.

        ``gates`` (optional, one scale vector per internal bond, already thresholded) weight
        the bonds: the chain strategy applies them to the rows' bonds (work proportional to
        the ids), the others fold them into the cores first.
        """
        if ids.dim() != 1:
            raise ValueError(f"lookup expects 1-d ids, got shape {tuple(ids.shape)}")
        if len(cores) != len(self.row_modes):
            raise ValueError(f"expected {len(self.row_modes)} cores, got {len(cores)}")
        if self.split == CHAIN:
            return self._chain_lookup(ids, cores, gates)
        if gates is not None:
            cores = [c * g.to(c.dtype) for c, g in zip(cores, gates)] + list(cores[len(gates) :])
        if self.split == 0:
            table = cores[0].reshape(self.row_modes[0], self.col_modes[0])
            return table.index_select(0, ids)
        left, right = self.tables(cores)
        _, n_left, rank, m_right, n_right = self.halves
        a = left.index_select(0, torch.div(ids, m_right, rounding_mode="floor"))
        b = right.index_select(0, torch.remainder(ids, m_right))
        out = torch.bmm(a.reshape(-1, n_left, rank), b.reshape(-1, rank, n_right))
        return out.reshape(ids.shape[0], n_left * n_right)

    def _chain_lookup(
        self, ids: Tensor, cores: Sequence[Tensor], gates: Sequence[Tensor] | None = None
    ) -> Tensor:
        """Contract the chain per row: gather the first core's slice, then one core at a time."""
        m, n = self.row_modes, self.col_modes
        digits, rest = [], ids
        for size in reversed(m):  # mixed radix, first mode most significant
            digits.append(torch.remainder(rest, size))
            rest = torch.div(rest, size, rounding_mode="floor")
        digits.reverse()
        rows = ids.shape[0]
        acc = cores[0][0].index_select(0, digits[0])  # (b, n_1, r_1)
        bucketed = not (torch.compiler.is_compiling() or _capturing())  # reads a depth
        for k in range(1, len(m)):
            if gates is not None:  # scale the bond between cores k-1 and k
                acc = acc * gates[k - 1].to(acc.dtype)
            step = _contract_bucketed if bucketed else _contract_gathered
            acc = step(acc, cores[k], digits[k])
        return acc.reshape(rows, math.prod(n))


def _capturing() -> bool:
    """True inside CUDA Graph capture, where the host may not read a tensor."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _contract_gathered(acc: Tensor, core: Tensor, digit: Tensor) -> Tensor:
    """``acc (b, w, r)`` times each row's slice ``core[:, digit]`` -> ``(b, w * n, r')``.

    Gathers one ``(r, n, r')`` slice per row: simple and traceable, but it moves a slice per
    row (in the forward gather and the backward scatter), which dominates at high ranks.
    """
    rows = acc.shape[0]
    g = core.index_select(1, digit).transpose(0, 1)  # (b, r, n, r')
    out = torch.bmm(acc, g.reshape(rows, core.shape[0], -1))
    return out.reshape(rows, -1, core.shape[3])


def _contract_bucketed(acc: Tensor, core: Tensor, digit: Tensor) -> Tensor:
    """Same result as :func:`_contract_gathered`, as one bmm over the core's ``m`` slices.

    Rows are put in buckets by their digit (padded to the fullest bucket), so each slice
    of the core is read once per batch instead of once per row, and the core's gradient
    comes straight out of the bmm's backward (no scatter of per-row slice gradients).
    The workspace is ``m * depth`` rows of ``(w, r)``: proportional to the ids when their
    digits spread (hashed ids do); ids sharing one digit (a run of small ids) make it up
    to ``m`` times larger.
    """
    rows, width, rank = acc.shape
    r, m, n, r_next = core.shape
    counts = torch.bincount(digit, minlength=m)
    depth = int(counts.max())
    order = torch.argsort(digit, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.empty_like(digit)
    slot[order] = torch.arange(rows, device=digit.device) - starts[digit[order]]
    place = digit * depth + slot
    buckets = acc.new_zeros(m * depth, width, rank).index_copy(0, place, acc)
    slices = core.permute(1, 0, 2, 3).reshape(m, r, n * r_next)
    out = torch.bmm(buckets.view(m, depth * width, rank), slices)
    return out.view(m * depth, width * n, r_next).index_select(0, place)


def chain_costs(
    row_modes: Sequence[int], col_modes: Sequence[int], ranks: Sequence[int], rows: int
) -> tuple[int, int]:
    """``(macs, peak)`` of the per-core gather + per-row chain strategy."""
    n, r = col_modes, ranks
    macs, width, peak = 0, n[0], rows * n[0] * r[1]
    for k in range(1, len(n)):
        macs += rows * width * r[k] * n[k] * r[k + 1]
        width *= n[k]
        peak = max(peak, rows * r[k] * n[k] * r[k + 1], rows * width * r[k + 1])
    return macs, peak


def split_costs(
    row_modes: Sequence[int], col_modes: Sequence[int], ranks: Sequence[int], rows: int
) -> dict[int, tuple[int, int, int]]:
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


def embedding_plan(
    row_modes: Sequence[int], col_modes: Sequence[int], ranks: int | Sequence[int], rows: int
) -> EmbeddingPlan:
    """The cheapest split for ``rows`` ids (bucketed to a power of two, cached).

    ``row_modes`` factor the vocabulary (m), ``col_modes`` the embedding dim (n); ranks as
    an int, the internal ranks, or the full ``[1, r.., 1]``.
    """
    m = _positive("row_modes", row_modes)
    n = _positive("col_modes", col_modes)
    if len(m) != len(n):
        raise ValueError(f"TTM needs as many row modes as col modes, got {list(m)} / {list(n)}")
    full = (1, *internal_ranks(ranks, len(m)), 1)
    return _embedding_plan(m, n, full, next_power_of_two(rows))
