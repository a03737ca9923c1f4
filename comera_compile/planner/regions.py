"""Plan regions: the row counts over which a contraction keeps one program.

A compiled graph serves every row count its shape guards admit. Plans are found per
power-of-two bucket of the rows, but a TT chain's best order changes only a few times over
all row counts: the cores merge first while the rows are few, the rows run through the
chain once they dominate (for the six-encoder's layers the last change is at 128 to 512
rows). So a symbolic row count is guarded to its *region*, the run of neighbouring buckets
whose plans are the same program, and batch sizes 8 to 4,096 share one graph where they
would have compiled one per bucket.

Finding a region plans the neighbouring buckets (cached, a few milliseconds each), out to
``MAX_BUCKET`` rows; a region that reaches it has no upper bound.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

MAX_BUCKET = 1 << 24  # beyond it the costs only scale with the rows: the plan stays


def region_of(program_at: Callable[[int], Hashable], bucket: int) -> tuple[int, int | None]:
    """``(low, high)``: the widest run of power-of-two buckets around ``bucket`` whose
    ``program_at(b)`` equals ``bucket``'s; ``high`` is None when the run reaches
    ``MAX_BUCKET`` (no upper bound)."""
    program = program_at(bucket)
    low = bucket
    while low > 1 and program_at(low // 2) == program:
        low //= 2
    high = bucket
    while high < MAX_BUCKET and program_at(high * 2) == program:
        high *= 2
    return low, None if high >= MAX_BUCKET else high


def guard_to_region(rows: int | torch.SymInt, low: int, high: int | None) -> None:
    """Check that ``rows`` lies in the buckets ``low..high``, i.e. ``low/2 < rows <= high``.

    On a symbolic ``rows`` each comparison becomes a shape guard, so the graph is reused
    for every row count of the region and recompiled outside it."""
    above = low == 1 or rows > low // 2
    below = high is None or rows <= high
    if not (above and below):
        raise AssertionError(f"{rows} rows lie outside the plan region {low}..{high}")
