"""Plan regions: the row counts one compiled graph serves with one contraction program."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

MAX_BUCKET = 1 << 24  # beyond it the costs only scale with the rows: the plan stays
SLACK = 0.1  # a region's plan may cost this much more than a bucket's own best plan


def region_of(plan_at: Callable[[int], Any], bucket: int,
              slack: float = SLACK) -> tuple[int, int | None]:
    """``(low, high)``: the widest run of power-of-two buckets around ``bucket`` where
    ``plan_at(bucket)`` costs at most ``1 + slack`` times ``plan_at(b)`` (plans with a
    ``cost_at(rows).cost``); ``high`` is None when the run reaches ``MAX_BUCKET``."""
    plan = plan_at(bucket)

    def serves(b: int) -> bool:
        return plan.cost_at(b).cost <= (1 + slack) * plan_at(b).cost_at(b).cost

    low = bucket
    while low > 1 and serves(low // 2):
        low //= 2
    high = bucket
    while high < MAX_BUCKET and serves(high * 2):
        high *= 2
    return low, None if high >= MAX_BUCKET else high


def guard_to_region(rows: int | torch.SymInt, low: int, high: int | None) -> None:
    """Check that ``rows`` lies in the buckets ``low..high``, i.e. ``low/2 < rows <= high``."""
    above = low == 1 or rows > low // 2
    below = high is None or rows <= high
    if not (above and below):
        raise AssertionError(f"{rows} rows lie outside the plan region {low}..{high}")
