"""Door checks for positive integers, shared by formats, planner and layers: fail at the
door with an error that names the argument and the fix."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence


def positive_int(name: str, value: object) -> int:
    """``value`` as an int >= 1 (numpy and torch integers accepted), or ValueError."""
    try:
        if isinstance(value, bool):
            raise TypeError
        out = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be a positive int (>= 1), got {value!r}") from None
    if out < 1:
        raise ValueError(f"{name} must be a positive int (>= 1), got {value!r}")
    return out


def positive_ints(name: str, values: Sequence[int]) -> tuple[int, ...]:
    """``values`` as a non-empty tuple of ints >= 1, or ValueError naming the bad entry."""
    try:
        items = list(values)
    except TypeError:
        raise ValueError(f"{name} must be a sequence of positive ints, got {values!r}") from None
    if not items:
        raise ValueError(f"{name} is empty; pass at least one mode (e.g. factorize(size, 1))")
    return tuple(positive_int(name, v) for v in items)


def ttm_mode_pairs(
    row_modes: Sequence[int],
    col_modes: Sequence[int],
    names: tuple[str, str] = ("row_modes", "col_modes"),
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Row and column modes of a TTM: positive ints, as many of one as of the other."""
    rows = positive_ints(names[0], row_modes)
    cols = positive_ints(names[1], col_modes)
    if len(rows) != len(cols):
        raise ValueError(
            f"TTM needs as many {names[0]} as {names[1]}, got {list(rows)} and {list(cols)}; "
            "use ttm_modes(rows, cols) to pick both with one order"
        )
    return rows, cols


def prod(values: Sequence[int]) -> int:
    """Integer product (1 for an empty sequence)."""
    return math.prod(int(v) for v in values)
