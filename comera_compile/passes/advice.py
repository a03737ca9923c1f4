"""Advice for models trained from scratch: when a narrower dense model is the better buy.

The pretraining frontier (``benchmarks/results/frontier.md``) races the from-scratch
default against dense models of every width. Where its default rows lost, both to the best
dense model at equal wall clock and to the dense model of equal parameters, ``summary``
suggests, for a from-scratch model compressed as far, the dense model of the same
parameters: the same depth at about the square root of the kept share of the width.
"""

from __future__ import annotations

import math

NARROW_DENSE_SHARE: float | None = 0.07
"""The kept share of parameters at or below which the frontier's default rows lost to the
dense models (None: no default row lost). A test reads ``benchmarks/results/frontier.md``
to keep it between the largest share of a losing default row and the smallest share of a
winning one."""

BEAT_DENSE = frozenset({"btt", "monarch"})
"""Formats with a frontier row that ended below the best dense model at its end time (kept in
step with ``benchmarks/results/frontier.md`` by the same test)."""


def narrow_dense_advice(init: str | None, params_before: int, params_after: int,
                        formats: set[str] | frozenset[str] = frozenset()) -> str:
    """The summary's line for a from-scratch model, or ``""`` where the race gives no
    reason for it (pretrained weights, nothing compressed, a share the default won at, or a
    model whose ``formats`` include one that beat the dense models)."""
    if init != "random" or not 0 < params_after < params_before:
        return ""
    share = params_after / params_before
    if NARROW_DENSE_SHARE is None or share > NARROW_DENSE_SHARE or set(formats) & BEAT_DENSE:
        return ""
    return (f"training from scratch at {share:.1%} of the parameters, a dense model of the same "
            f"depth at about {math.sqrt(share):.2f}x the width ({params_after:,} parameters, "
            "as many as this one) may be the better buy: in the pretraining frontier "
            "(benchmarks/frontier.py) the default format kept this little lost to the dense "
            "model of equal parameters and to the best dense width at equal training time")
