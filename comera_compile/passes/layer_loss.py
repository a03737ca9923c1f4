"""Layer losses: what a layer loses at each size, for the allocator to minimise in sum.

Training from scratch (``init="random"``) has no weights to protect: capacity is spread so
every layer is compressed alike (the loss ``-dense_params * log(params)`` is minimised under a
parameter budget exactly when ``params`` is proportional to ``dense_params``). A pretrained
model (``init="dense"``) loses what TT-SVD truncates: the relative squared error of each layer,
times how much its inputs feel it (``spectra.output_weights``), summed over layers.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from comera_compile.passes.allocate import Ranks
from comera_compile.passes.spectra import Spectrum

Loss = Callable[[Ranks | None], float]


def capacity_loss(dense_params: int, params: Callable[[Ranks | None], int]) -> Loss:
    """Equal compression everywhere: ``-dense_params * log(params)``."""
    return lambda ranks: -dense_params * math.log(params(ranks))


def error_loss(spectrum: Spectrum, weight: float = 1.0) -> Loss:
    """Weighted relative squared TT-SVD error; a dense layer loses nothing."""
    return lambda ranks: 0.0 if ranks is None else weight * spectrum.relative_sq_error(ranks)
