"""A chain's layout from a layer's arguments: modes per side and the full rank list."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ._checks import positive_int, positive_ints
from .btt import btt_modes, check_btt_modes
from .factorize import tt_linear_modes, ttm_modes
from .monarch import DEFAULT_BLOCKS, check_monarch_modes, monarch_modes
from .ranks import fit_ranks

TT, TTM, LOWRANK, COLA, TT_EMBEDDING = "tt", "ttm", "lowrank", "cola", "tt_embedding"
"""The layer formats: TT and TTM Linear, low-rank ``W = U V`` (a TT chain of order 1),
CoLA's low-rank with a nonlinearity on the bond (laid out as low-rank), and the
TTM-format embedding table."""
BTT, MONARCH = "btt", "monarch"
"""Block tensor-train and Monarch Linear layers (``formats.btt``, ``formats.monarch``): two
block-diagonal factors each, full rank; BTT has a rank bond, Monarch a block count."""
TT_CHAINS = (TT, LOWRANK, COLA)  # single-mode cores: input modes, then output modes
ONE_MODE = (LOWRANK, COLA)  # chains of order 1: one mode per side

_ARGUMENT_NAMES = {  # the constructors' names of (sizes, modes), for errors in their words
    TT_EMBEDDING: ("num_embeddings", "embedding_dim", "row_modes", "col_modes"),
}
_LINEAR_NAMES = ("in_features", "out_features", "in_modes", "out_modes")


@dataclass(frozen=True)
class ChainLayout:
    """The modes of both sides and the full ranks ``[1, r_1, .., 1]`` of a chain."""

    first: tuple[int, ...]
    second: tuple[int, ...]
    ranks: list[int]


def modes_cover(name: str, modes: Sequence[int], features: int) -> tuple[int, ...]:
    """Modes must be positive ints whose product covers the feature count (padding allowed)."""
    modes = positive_ints(name, modes)
    if math.prod(modes) < features:
        raise ValueError(
            f"{name}={list(modes)} multiply to {math.prod(modes)} < {features}; choose modes "
            f"whose product is at least {features} (leave them as None to factorize "
            "automatically, padding where the size does not factor)"
        )
    return modes


def check_low_rank(order: int | None, in_modes: Sequence[int] | None,
                   out_modes: Sequence[int] | None) -> None:
    """A low-rank ``W = U V`` is a TT chain with one mode per side: refuse anything else."""
    if order not in (None, 1):
        raise ValueError(f"a low-rank layer has one mode per side (order 1), got order={order!r}; "
                         "use TTLinear (format='tt') for higher orders")
    for name, modes in (("in_modes", in_modes), ("out_modes", out_modes)):
        if modes is not None and len(modes) != 1:
            raise ValueError(f"a low-rank layer has one mode per side, got {name}={list(modes)}; "
                             "leave it as None or use TTLinear (format='tt') for several modes")


def chain_layout(fmt: str, first_size: int, second_size: int, ranks: int | Sequence[int],
                 first_modes: Sequence[int] | None = None,
                 second_modes: Sequence[int] | None = None,
                 order: int | None = None) -> ChainLayout:
    """The layout a layer of format ``fmt`` gets: sizes are ``(in_features, out_features)``
    for a Linear and ``(num_embeddings, embedding_dim)`` for an embedding. Modes not given
    are factorized (a TTM chain takes its order from given modes); ``ranks`` is an int or a
    rank list, clipped to what each bond can hold."""
    if fmt not in (*TT_CHAINS, TTM, TT_EMBEDDING, BTT, MONARCH):
        raise ValueError(
            f"unknown format {fmt!r}; use one of {(TT, TTM, LOWRANK, COLA, BTT, MONARCH)}")
    names = _ARGUMENT_NAMES.get(fmt, _LINEAR_NAMES)
    first_size = positive_int(names[0], first_size)
    second_size = positive_int(names[1], second_size)
    if fmt in (BTT, MONARCH):
        return _block_layout(fmt, first_size, second_size, ranks, first_modes, second_modes,
                             order)
    if fmt in ONE_MODE:
        check_low_rank(order, first_modes, second_modes)
        order = 1
    if fmt in TT_CHAINS:
        auto = tt_linear_modes(first_size, second_size, order)
    else:
        if order is None and (first_modes is not None or second_modes is not None):
            order = len(first_modes if first_modes is not None else second_modes)
        # the weight's rows are the output side: TTM row modes descend (see ttm_modes)
        auto = ttm_modes(first_size, second_size, order)
        if fmt == TTM:
            auto = ttm_modes(second_size, first_size, order)[::-1]
    ms = modes_cover(names[2], first_modes or auto[0].modes, first_size)
    ns = modes_cover(names[3], second_modes or auto[1].modes, second_size)
    if fmt in TT_CHAINS:
        return ChainLayout(ms, ns, fit_ranks(ms + ns, ranks))
    if len(ms) != len(ns):
        fix = (
            "give one row mode per col mode (one pair per core)"
            if fmt == TT_EMBEDDING
            else "use TTLinear (format='tt') for unequal orders"
        )
        raise ValueError(
            f"a TTM chain pairs its modes, so {names[2]}={list(ms)} and {names[3]}={list(ns)} "
            f"need the same length; {fix}"
        )
    return ChainLayout(ms, ns, fit_ranks([m * n for m, n in zip(ms, ns)], ranks))


def _block_layout(fmt: str, in_features: int, out_features: int, ranks: int | Sequence[int],
                  in_modes: Sequence[int] | None, out_modes: Sequence[int] | None,
                  order: int | None) -> ChainLayout:
    """BTT: two modes per side and one rank ``[1, r, 1]`` (an int is clipped to the rank
    that holds every matrix). Monarch: ``(blocks, block size)`` per side and no rank
    (``[1, 1]``); ``ranks`` is ignored."""
    if order not in (None, 2):
        raise ValueError(f"format={fmt!r} has two factors (order 2), got order={order!r}")
    if fmt == MONARCH:
        if in_modes is None and out_modes is None:
            in_modes, out_modes = monarch_modes(in_features, out_features, DEFAULT_BLOCKS)
        elif in_modes is None or out_modes is None:
            blocks = (in_modes or out_modes)[0]
            auto = monarch_modes(in_features, out_features, blocks)
            in_modes, out_modes = in_modes or auto[0], out_modes or auto[1]
        check_monarch_modes(in_modes, out_modes)
        ms = modes_cover("in_modes", in_modes, in_features)
        ns = modes_cover("out_modes", out_modes, out_features)
        return ChainLayout(ms, ns, [1, 1])
    auto = btt_modes(in_features, out_features)
    ms = tuple(in_modes) if in_modes is not None else auto[0]
    ns = tuple(out_modes) if out_modes is not None else auto[1]
    check_btt_modes(ms, ns)
    ms = modes_cover("in_modes", ms, in_features)
    ns = modes_cover("out_modes", ns, out_features)
    return ChainLayout(ms, ns, fit_ranks([ms[1], ns[1]], ranks))


def lowrank_table_modes(rows: int, dim: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Row and column modes that make a TT table low rank: cores ``(1, rows, 1, r)`` and
    ``(r, 1, dim, 1)``, so the table is ``A @ B`` and one lookup costs ``r * dim``."""
    return (int(rows), 1), (1, int(dim))


def is_lowrank_table(row_modes: Sequence[int], col_modes: Sequence[int]) -> bool:
    """Whether a TT table's modes are the low-rank layout of ``lowrank_table_modes``."""
    return (len(row_modes) == 2 and len(col_modes) == 2 and int(row_modes[1]) == 1
            and int(col_modes[0]) == 1)
