"""A chain's layout from a layer's arguments: modes per side and the full rank list.

Layer constructors and the selection pass both need "what would this layer be" from the
same arguments (sizes, optional modes, order, ranks); this module answers it once, with
pure arithmetic, so checking a user's settings never builds a layer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ._checks import positive_int, positive_ints
from .factorize import tt_linear_modes, ttm_modes
from .ranks import fit_ranks


@dataclass(frozen=True)
class ChainLayout:
    """Modes of the two sides of a matrix and the full ranks ``[1, r_1, .., 1]`` of its chain.

    For TT and TTM Linear layers ``first`` are the input modes and ``second`` the output
    modes; for an embedding table they are the vocabulary (row) and embedding-dim (column)
    modes.
    """

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


def tt_layout(
    in_features: int,
    out_features: int,
    ranks: int | Sequence[int],
    in_modes: Sequence[int] | None = None,
    out_modes: Sequence[int] | None = None,
    order: int | None = None,
) -> ChainLayout:
    """A TT-linear chain: input cores then output cores (modes chosen when not given)."""
    in_features = positive_int("in_features", in_features)
    out_features = positive_int("out_features", out_features)
    auto_in, auto_out = tt_linear_modes(in_features, out_features, order)
    ins = modes_cover("in_modes", in_modes or auto_in.modes, in_features)
    outs = modes_cover("out_modes", out_modes or auto_out.modes, out_features)
    return ChainLayout(ins, outs, fit_ranks(ins + outs, ranks))


def ttm_layout(
    rows: int,
    cols: int,
    ranks: int | Sequence[int],
    row_modes: Sequence[int] | None = None,
    col_modes: Sequence[int] | None = None,
    order: int | None = None,
    names: tuple[str, str, str, str] = ("rows", "cols", "row_modes", "col_modes"),
) -> ChainLayout:
    """A TTM chain of ``rows x cols``, one core per (row mode, col mode) pair; the order
    follows given modes. ``names`` are the caller's names of the four arguments (sizes,
    then modes), so that errors speak the caller's words."""
    rows = positive_int(names[0], rows)
    cols = positive_int(names[1], cols)
    names = names[2:]
    if order is None and (row_modes is not None or col_modes is not None):
        order = len(row_modes if row_modes is not None else col_modes)
    auto_rows, auto_cols = ttm_modes(rows, cols, order)
    ms = modes_cover(names[0], row_modes or auto_rows.modes, rows)
    ns = modes_cover(names[1], col_modes or auto_cols.modes, cols)
    if len(ms) != len(ns):
        raise ValueError(
            f"a TTM chain pairs its modes, so {names[0]}={list(ms)} and {names[1]}={list(ns)} "
            "need the same length; use TTLinear (format='tt') for unequal orders"
        )
    return ChainLayout(ms, ns, fit_ranks([m * n for m, n in zip(ms, ns)], ranks))


def ttm_linear_layout(
    in_features: int,
    out_features: int,
    ranks: int | Sequence[int],
    in_modes: Sequence[int] | None = None,
    out_modes: Sequence[int] | None = None,
    order: int | None = None,
) -> ChainLayout:
    """A TTM Linear: the weight ``(out, in)`` is the TTM matrix; ``first`` = input modes."""
    names = ("out_features", "in_features", "out_modes", "in_modes")
    chain = ttm_layout(out_features, in_features, ranks, out_modes, in_modes, order, names)
    return ChainLayout(chain.second, chain.first, chain.ranks)


def embedding_layout(
    num_embeddings: int,
    embedding_dim: int,
    ranks: int | Sequence[int],
    row_modes: Sequence[int] | None = None,
    col_modes: Sequence[int] | None = None,
    order: int | None = None,
) -> ChainLayout:
    """A TTM embedding table: ``first`` = vocabulary (row) modes, ``second`` = dim modes."""
    names = ("num_embeddings", "embedding_dim", "row_modes", "col_modes")
    return ttm_layout(num_embeddings, embedding_dim, ranks, row_modes, col_modes, order, names)


def check_low_rank(
    order: int | None, in_modes: Sequence[int] | None, out_modes: Sequence[int] | None
) -> None:
    """A low-rank ``W = U V`` is a TT chain with one mode per side: refuse anything else."""
    if order not in (None, 1):
        raise ValueError(
            f"a low-rank layer has one mode per side (order 1), got order={order!r}; "
            "use TTLinear (format='tt') for higher orders"
        )
    for name, modes in (("in_modes", in_modes), ("out_modes", out_modes)):
        if modes is not None and len(modes) != 1:
            raise ValueError(
                f"a low-rank layer has one mode per side, got {name}={list(modes)}; "
                "leave it as None or use TTLinear (format='tt') for several modes"
            )
