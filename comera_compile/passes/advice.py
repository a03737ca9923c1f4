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
"""The frontier's verdict: True when no compressed format beat the best dense model at
equal wall clock (a test reads ``benchmarks/results/frontier.md`` to keep the two in step)."""


def narrow_dense_advice(init: str | None, params_before: int, params_after: int) -> str:
    """The summary's line for a from-scratch model, or ``""`` where the race gives no
    reason for it (pretrained weights, nothing compressed, or a format that won)."""
    if not NARROW_DENSE_WINS or init != "random" or not 0 < params_after < params_before:
        return ""
    width = math.sqrt(params_after / params_before)
    return (f"training from scratch, a dense model of the same depth at about {width:.2f}x the "
            f"width ({params_after:,} parameters, as many as this one) is the better buy: in the "
            "pretraining frontier (benchmarks/frontier.py) no compressed row that ran reached a "
            "lower held-out loss than the best dense width at equal training time")
