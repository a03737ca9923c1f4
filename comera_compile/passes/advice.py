"""Advice for models trained from scratch: when a narrower dense model is the better buy."""

from __future__ import annotations

import math

NARROW_DENSE_WINS = False
"""The frontier's verdict on the from-scratch default format (CoLA): True when none of its
rows reached a lower held-out loss than the best dense model at equal wall clock (a test
reads ``benchmarks/results/frontier.md`` to keep the two in step)."""

BEAT_DENSE = frozenset({"btt", "monarch"})
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
