"""Advice for models trained from scratch: when a narrower dense model is the better buy.

The pretraining frontier (``benchmarks/frontier.py``; its verdict in
``benchmarks/results/frontier.md``) trains dense models of several widths and every
compressed format at the dense widths' parameter counts, and asks whether any compressed
model ends below every dense model at equal wall clock. Where none does, the honest advice to
someone compressing a model they will train from scratch is the dense model of the same
parameter count: the same depth at about the square root of the kept share of the width
(parameters grow with width squared). ``summary`` prints that line; it says nothing for
pretrained weights (``init="dense"``), where a narrower model would start from nothing.
"""

from __future__ import annotations

import math

NARROW_DENSE_WINS = True
"""The frontier's verdict on the from-scratch default format (CoLA): True when none of its
rows reached a lower held-out loss than the best dense model at equal wall clock (a test
reads ``benchmarks/results/frontier.md`` to keep the two in step)."""

BEAT_DENSE = frozenset({"btt"})
"""Formats with a frontier row that ended below the best dense model at its end time (kept in
step with ``benchmarks/results/frontier.md`` by the same test)."""


def narrow_dense_advice(init: str | None, params_before: int, params_after: int,
                        formats: set[str] | frozenset[str] = frozenset()) -> str:
    """The summary's line for a from-scratch model, or ``""`` where the race gives no
    reason for it (pretrained weights, nothing compressed, or a model whose ``formats``
    include one that beat the dense models)."""
    if not NARROW_DENSE_WINS or init != "random" or not 0 < params_after < params_before:
        return ""
    if set(formats) & BEAT_DENSE:
        return ""
    width = math.sqrt(params_after / params_before)
    better = (f"; format={sorted(BEAT_DENSE)[0]!r} did (benchmarks/results/frontier.md)"
              if BEAT_DENSE else "")
    return (f"training from scratch, a dense model of the same depth at about {width:.2f}x the "
            f"width ({params_after:,} parameters, as many as this one) may be the better buy: "
            "in the pretraining frontier (benchmarks/frontier.py) no row of the default format "
            "reached a lower held-out loss than the best dense width at equal training time"
            f"{better}")
