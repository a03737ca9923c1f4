"""Structure-aware scales: each core's fan-in, its init std and its learning-rate share."""

from __future__ import annotations

import math
from collections.abc import Sequence


def tt_linear_fan_ins(in_modes: Sequence[int], ranks: Sequence[int]) -> list[int]:
    """TT linear (input cores, then output cores): an input core sums its mode and its left
    bond, an output core only its left bond."""
    d = len(in_modes)
    num = len(ranks) - 1
    return [ranks[k] * (in_modes[k] if k < d else 1) for k in range(num)]


def ttm_fan_ins(in_modes: Sequence[int], ranks: Sequence[int]) -> list[int]:
    """TTM linear: every core sums its input mode and its left bond."""
    return [ranks[k] * n for k, n in enumerate(in_modes)]


def lookup_fan_ins(ranks: Sequence[int]) -> list[int]:
    """An embedding chain: a gathered core sums only its left bond (the first, nothing)."""
    return [ranks[k] for k in range(len(ranks) - 1)]


def fan_in_stds(fan_ins: Sequence[int], ranks: Sequence[int], sigma: float) -> list[float]:
    """Per-core stds ``c / sqrt(F_k)`` whose chain product has entry variance ``sigma**2``."""
    if sigma < 0:
        raise ValueError(f"sigma must be >= 0, got {sigma!r}")
    num = len(fan_ins)
    log_c2 = (2 * math.log(sigma) if sigma > 0 else -math.inf) + sum(
        math.log(f) for f in fan_ins
    ) - sum(math.log(r) for r in ranks[1:-1])
    c2 = math.exp(log_c2 / num) if sigma > 0 else 0.0
    return [math.sqrt(c2 / f) for f in fan_ins]


def lr_multipliers(fan_ins: Sequence[int], dense_fan_in: int) -> list[float]:
    """Each core's learning rate over the dense layer's: ``F / (L * F_k)``."""
    num = len(fan_ins)
    return [dense_fan_in / (num * f) for f in fan_ins]
