"""Door checks of the layer constructors that only layers need: every bad argument gets an
error that names the fix, before any tensor is allocated. Positive ints and rank lists are
checked by ``comera_compile.formats`` (``positive_int``, ``fit_ranks``), as everywhere."""

from __future__ import annotations

import math
from collections.abc import Sequence

from comera_compile.formats import positive_ints


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
