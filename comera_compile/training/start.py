"""Where a rank-adaptive run starts: larger than the size it should end at."""

from __future__ import annotations

START_FACTOR = 2.0
"""A rank-adaptive run starts at this multiple of the size it ends at."""


def start_budget(budget: float, factor: float = START_FACTOR) -> float:
    """The share of the dense model to ``optimize`` for a rank-adaptive run that ends at
    ``budget`` (a share in (0, 1]): ``factor`` times it, at most the whole model."""
    if isinstance(budget, bool) or not isinstance(budget, float) or not 0 < budget <= 1:
        raise ValueError(
            f"budget must be the share of the dense model to end with, a float in (0, 1], "
            f"got {budget!r} (for '8x' pass 0.125)"
        )
    if not factor >= 1:
        raise ValueError(f"factor must be at least 1 (start no smaller than the end), got "
                         f"{factor!r}")
    return min(1.0, factor * budget)


def end_ratio(budget: float, factor: float = START_FACTOR) -> float:
    """The share of the start size (``start_budget(budget)``) that ``budget`` is."""
    return budget / start_budget(budget, factor)
