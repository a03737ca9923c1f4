"""Layer specs: the format, modes and ranks a candidate would get, and what that costs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from comera_compile.formats import (
    BTT,
    COLA,
    LOWRANK,
    MONARCH,
    TT,
    TT_CHAINS,
    TTM,
    chain_layout,
    clip_ranks,
    tt_linear_macs,
    tt_linear_params,
    ttm_linear_macs,
    ttm_params,
)
from comera_compile.formats.btt import btt_params
from comera_compile.formats.monarch import monarch_params
from comera_compile.passes.candidates import Candidate

LINEAR_FORMATS = (TT, TTM, LOWRANK, COLA, BTT, MONARCH)
BLOCK_FORMATS = (BTT, MONARCH)  # two block-diagonal factors, a fixed forward of two bmm


def check_format(fmt: str, name: str = "format") -> None:
    """``fmt`` must name a Linear format: ``"tt"``, ``"ttm"``, ``"lowrank"``, ``"cola"``,
    ``"btt"`` or ``"monarch"``."""
    if fmt not in LINEAR_FORMATS:
        raise ValueError(f"{name} must be one of {LINEAR_FORMATS}, got {fmt!r}")


@dataclass(frozen=True)
class LayerSpec:
    """How one layer is tensorized."""

    format: str
    in_features: int
    out_features: int
    in_modes: tuple[int, ...]
    out_modes: tuple[int, ...]
    ranks: tuple[int, ...]  # full list, boundary 1s included
    bias: bool

    @property
    def row_modes(self) -> tuple[int, ...]:
        """An embedding's vocabulary modes (``in_modes``)."""
        return self.in_modes

    @property
    def col_modes(self) -> tuple[int, ...]:
        """An embedding's embedding-dim modes (``out_modes``)."""
        return self.out_modes

    @property
    def chain_dims(self) -> list[int]:
        """The sizes whose matricizations cap each rank: a BTT's bond is capped by its
        blocks' ``(m0, n1)``; Monarch has no bond (one dim: no rank to choose)."""
        if self.format == BTT:
            return [self.in_modes[1], self.out_modes[1]]
        if self.format == MONARCH:
            return [self.in_features * self.out_features]
        if self.format in TT_CHAINS:
            return [*self.in_modes, *self.out_modes]
        return [m * n for m, n in zip(self.in_modes, self.out_modes)]

    @property
    def params(self) -> int:
        """Cores + gates + bias: exactly the built layer's parameter count."""
        if self.format == BTT:
            cores = btt_params(self.in_modes, self.out_modes, self.ranks[1])
        elif self.format == MONARCH:
            cores = monarch_params(self.in_modes, self.out_modes)
        elif self.format in TT_CHAINS:
            cores = tt_linear_params(self.in_modes, self.out_modes, self.ranks)
        elif self.format == TTM:  # cores are (r, out mode, in mode, r)
            cores = ttm_params(self.out_modes, self.in_modes, self.ranks)
        else:
            cores = ttm_params(self.in_modes, self.out_modes, self.ranks)
        return cores + sum(self.ranks[1:-1]) + (self.out_features if self.bias else 0)

    def macs(self, rows: int, calls: int = 1) -> int:
        """Forward multiply-adds for ``rows`` input rows over ``calls`` calls."""
        if self.format in BLOCK_FORMATS:  # every core entry once per row
            return rows * self.macs_per_row()
        if self.format in TT_CHAINS:
            per_row = tt_linear_macs(1, self.in_modes, self.out_modes, self.ranks, False)
            merge = tt_linear_macs(0, self.in_modes, self.out_modes, self.ranks, True)
            return rows * per_row + calls * merge
        if self.format == TTM:
            return ttm_linear_macs(rows, self.out_modes, self.in_modes, self.ranks)
        return rows * embedding_macs_per_row(self.out_modes, self.ranks)

    def macs_per_row(self) -> int:
        """Multiply-adds per input row, leaving out batch-independent core merges."""
        if self.format == BTT:
            return btt_params(self.in_modes, self.out_modes, self.ranks[1])
        if self.format == MONARCH:
            return monarch_params(self.in_modes, self.out_modes)
        if self.format in TT_CHAINS:
            return tt_linear_macs(1, self.in_modes, self.out_modes, self.ranks, False)
        return self.macs(1)


def embedding_macs_per_row(col_modes: Sequence[int], ranks: Sequence[int]) -> int:
    """Building one row from its gathered core slices ``(r, n_k, r)`` left to right."""
    macs, width = 0, 1
    for k, n in enumerate(col_modes):
        width *= n
        if k > 0:
            macs += width * ranks[k] * ranks[k + 1]
    return macs


def auto_modes(cand: Candidate, fmt: str, in_modes: Sequence[int] | None = None,
               out_modes: Sequence[int] | None = None,
               order: int | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The modes the layer constructor would pick (user-given modes win)."""
    chain = chain_layout(fmt, cand.in_features, cand.out_features, 1, in_modes, out_modes, order)
    return chain.first, chain.second


def make_spec(cand: Candidate, fmt: str, rank: int | Sequence[int], in_modes: Sequence[int],
              out_modes: Sequence[int]) -> LayerSpec:
    """Spec at a rank cap (an int, clipped per bond) or an explicit full rank list."""
    spec = LayerSpec(fmt, cand.in_features, cand.out_features, tuple(in_modes),
                     tuple(out_modes), (), cand.bias and not cand.is_embedding)
    ranks = clip_ranks(spec.chain_dims, rank) if isinstance(rank, int) else list(rank)
    return LayerSpec(**{**spec.__dict__, "ranks": tuple(ranks)})


def max_useful_rank(spec: LayerSpec) -> int:
    """The rank cap above which no bond grows (the widest matricization)."""
    return max(clip_ranks(spec.chain_dims, math.prod(spec.chain_dims)))
