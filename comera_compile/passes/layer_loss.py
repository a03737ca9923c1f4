"""Layer losses: what a layer loses at each size, for the allocator to minimise in sum."""

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
