"""Rank lists of a chain of cores, in one place."""

from __future__ import annotations

import operator
from collections.abc import Sequence

from ._checks import positive_int, positive_ints, prod


def internal_ranks(ranks: int | Sequence[int], num_cores: int, name: str = "ranks") -> list[int]:
    """The ``num_cores - 1`` internal ranks from an int, the internal ranks or the full list."""
    bonds = num_cores - 1
    if _is_integer(ranks):
        return [positive_int(name, ranks)] * bonds
    try:
        given = list(ranks)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{name} must be an int or a list of ints, got {ranks!r}") from None
    if len(given) == bonds + 2:
        if given[0] != 1 or given[-1] != 1:
            raise ValueError(f"{name}: the boundary ranks must be 1, got {given}")
        given = given[1:-1]
    if len(given) != bonds:
        raise ValueError(
            f"{name} has {len(given)} entries but {num_cores} cores have {bonds} internal "
            f"ranks: pass one int, the {bonds} internal ranks or all {bonds + 2} with the "
            "boundary 1s (clip_ranks(dims, rank) builds them)"
        )
    return [positive_int(name, r) for r in given]


def chain_ranks(ranks: int | Sequence[int], num_cores: int, name: str = "ranks") -> list[int]:
    """The full rank list ``[1, r_1, ..., r_{L-1}, 1]`` of a chain of ``num_cores`` cores."""
    return [1, *internal_ranks(ranks, num_cores, name), 1]


def rank_caps(dims: Sequence[int]) -> list[int]:
    """The largest useful rank of each internal bond: the rank of the matricization there,
    ``min(prod(dims[:k]), prod(dims[k:]))``; larger ranks only waste parameters."""
    dims = positive_ints("dims", dims)
    return [min(prod(dims[:k]), prod(dims[k:])) for k in range(1, len(dims))]


def clip_ranks(dims: Sequence[int], rank: int | Sequence[int]) -> list[int]:
    """Full rank list ``[1, r_1, ..., r_{L-1}, 1]`` with each bond clipped to its cap."""
    caps = rank_caps(dims)
    requested = internal_ranks(rank, len(caps) + 1, "rank")
    return [1, *(min(r, c) for r, c in zip(requested, caps)), 1]


def fit_ranks(dims: Sequence[int], ranks: int | Sequence[int]) -> list[int]:
    """The full rank list a layer over ``dims`` accepts: an int is a cap (clipped per bond to
    what the modes allow); an explicit list must fit the modes or we say which bonds don't."""
    if _is_integer(ranks):
        return clip_ranks(dims, positive_int("ranks", ranks))
    caps = rank_caps(dims)
    wanted = internal_ranks(ranks, len(caps) + 1)
    too_big = [(k + 1, r, c) for k, (r, c) in enumerate(zip(wanted, caps)) if r > c]
    if too_big:
        detail = ", ".join(f"bond {k}: {r} > {c}" for k, r, c in too_big)
        raise ValueError(f"ranks {wanted} are larger than the modes {list(dims)} allow ({detail}); "
                         f"use at most {caps}, or pass an int to clip automatically")
    return [1, *wanted, 1]


def _is_integer(value: object) -> bool:
    """True for ints, numpy and torch integer scalars (and bools, which positive_int refuses)."""
    if isinstance(value, (list, tuple)):  # the common case, decided without raising:
        return False  # some torch.compile versions cannot trace a caught TypeError
    try:
        operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True
