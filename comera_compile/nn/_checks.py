"""Door checks shared by the layer constructors: every bad argument gets an error that names
the fix, before any tensor is allocated."""

from __future__ import annotations

import math
from collections.abc import Sequence

from comera_compile.formats import clip_ranks


def positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def modes_cover(name: str, modes: Sequence[int], features: int) -> tuple[int, ...]:
    """Modes must be positive ints whose product covers the feature count (padding allowed)."""
    modes = tuple(int(m) for m in modes)
    if not modes or any(m < 1 for m in modes):
        raise ValueError(f"{name} must be a non-empty list of positive ints, got {modes}")
    if math.prod(modes) < features:
        raise ValueError(
            f"{name}={list(modes)} multiply to {math.prod(modes)} < {features}; choose modes "
            f"whose product is at least {features} (leave them as None to factorize "
            "automatically, padding where the size does not factor)"
        )
    return modes


def full_ranks(dims: Sequence[int], ranks: int | Sequence[int]) -> list[int]:
    """Rank list ``[1, r_1, ..., 1]``: an int is a cap (clipped per bond to what the modes
    allow); an explicit list must fit the modes exactly or we say which bonds are too big."""
    n_bonds = len(dims) - 1
    if isinstance(ranks, int) and not isinstance(ranks, bool):
        positive_int("ranks", ranks)
        return clip_ranks(dims, ranks)
    ranks = [int(r) for r in ranks]
    if len(ranks) == n_bonds + 2 and ranks[0] == ranks[-1] == 1:
        ranks = ranks[1:-1]
    if len(ranks) != n_bonds:
        raise ValueError(
            f"ranks must be an int or a list of {n_bonds} internal ranks (or {n_bonds + 2} with "
            f"the boundary 1s), got {len(ranks)} values"
        )
    if any(r < 1 for r in ranks):
        raise ValueError(f"ranks must be positive, got {ranks}")
    caps = clip_ranks(dims, math.prod(dims))[1:-1]
    too_big = [(k + 1, r, c) for k, (r, c) in enumerate(zip(ranks, caps)) if r > c]
    if too_big:
        detail = ", ".join(f"bond {k}: {r} > {c}" for k, r, c in too_big)
        raise ValueError(
            f"ranks {ranks} are larger than the modes {list(dims)} allow ({detail}); "
            f"use at most {caps}, or pass an int to clip automatically"
        )
    return [1, *ranks, 1]
