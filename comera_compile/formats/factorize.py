"""Choose tensor modes and ranks: split sizes into balanced factors, padding when needed."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch.nn.functional as F
from torch import Tensor

from ._checks import positive_int, prod

# A factorization is "good" if no factor exceeds this multiple of size**(1/order).
_MAX_FACTOR_RATIO = 2.0
# choose_order aims at modes of about this size.
_TARGET_MODE = 12.0


@dataclass(frozen=True)
class Factorization:
    """Modes whose product covers ``size``; ``padding`` extra rows/cols pad it exactly."""

    size: int
    modes: tuple[int, ...]

    @property
    def padded(self) -> int:
        """Product of the modes (the padded size)."""
        return prod(self.modes)

    @property
    def padding(self) -> int:
        """How many entries the padded size adds to ``size``."""
        return self.padded - self.size

    @property
    def order(self) -> int:
        """Number of modes."""
        return len(self.modes)


def zero_pad(matrix: Tensor, rows: int, cols: int) -> Tensor:
    """``matrix`` with zero rows and columns appended up to ``(rows, cols)``: a dense weight
    brought to the padded sizes of its Factorizations before a TT/TTM-SVD."""
    if matrix.dim() != 2 or matrix.shape[0] > rows or matrix.shape[1] > cols:
        raise ValueError(
            f"cannot zero-pad a matrix of shape {tuple(matrix.shape)} to {rows} x {cols}"
        )
    return F.pad(matrix, (0, cols - matrix.shape[1], 0, rows - matrix.shape[0]))


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _tuples(n: int, order: int, lo: int, divs: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """All nondecreasing tuples of ``order`` divisors >= lo whose product is ``n``."""
    if order == 1:
        if n >= lo:
            yield (n,)
        return
    for d in divs:
        if d < lo:
            continue
        if d**order > n:
            break
        if n % d == 0:
            for rest in _tuples(n // d, order - 1, d, divs):
                yield (d, *rest)


def _balance_key(modes: tuple[int, ...], n: int) -> tuple[int, int, float, tuple[int, ...]]:
    # Smallest max factor, then largest min factor (smallest max/min), then spread.
    log_root = math.log(n) / len(modes)
    spread = sum((math.log(m) - log_root) ** 2 for m in modes)
    return (max(modes), -min(modes), round(spread, 12), modes)


@lru_cache(maxsize=4096)
def _balanced(n: int, order: int) -> tuple[int, ...]:
    """Most balanced exact factorization of ``n`` into ``order`` factors, ascending."""
    divs = _divisors(n)
    return min(_tuples(n, order, 1, divs), key=lambda t: _balance_key(t, n))


def _is_good(modes: tuple[int, ...], n: int) -> bool:
    order = len(modes)
    if order == 1:
        return True
    return min(modes) > 1 and max(modes) <= _MAX_FACTOR_RATIO * n ** (1.0 / order)


def _is_smooth(n: int, bound: float) -> bool:
    """True if every prime factor of ``n`` is <= bound (cheap pre-filter for padding)."""
    for p in range(2, int(bound) + 1):
        while n % p == 0:
            n //= p
        if n == 1:
            return True
    return n == 1


def factorize(size: int, order: int, max_padding: float = 0.1) -> Factorization:
    """Split ``size`` into ``order`` balanced modes (ascending), padding up if it factors badly."""
    size = positive_int("size", size)
    try:
        order = positive_int("order", order)
    except ValueError as exc:
        raise ValueError(f"{exc}; use choose_order(size) for a default") from None
    if max_padding < 0:
        raise ValueError(f"max_padding must be >= 0 (a fraction of size), got {max_padding!r}")
    if order == 1:
        return Factorization(size, (size,))
    if size == 1:
        return Factorization(size, (1,) * order)
    limit = max(size, math.floor(size * (1.0 + max_padding)))
    for n in range(size, limit + 1):
        if not _is_smooth(n, _MAX_FACTOR_RATIO * n ** (1.0 / order)):
            continue
        modes = _balanced(n, order)
        if _is_good(modes, n):
            return Factorization(size, modes)
    # Nothing in range is good (tiny sizes, order too high): least unbalanced candidate.
    best = min(range(size, limit + 1),
               key=lambda n: (_balanced(n, order)[-1] / _balanced(n, order)[0], n))
    return Factorization(size, _balanced(best, order))


def choose_order(size: int) -> int:
    """Default number of modes: about log_12(size), so modes land near 8-16."""
    size = positive_int("size", size)
    if size < 16:
        return 1
    return max(2, math.floor(math.log(size) / math.log(_TARGET_MODE) + 0.5))


def _resolve_order(order: int | None, *sizes: int) -> int:
    if order is None:
        return max(choose_order(s) for s in sizes)
    return positive_int("order (or None for automatic)", order)


def tt_linear_modes(in_features: int, out_features: int,
                    order: int | None = None) -> tuple[Factorization, Factorization]:
    """Modes for a TT-linear chain: input modes descending, output modes ascending."""
    return _descending_then_ascending(in_features, out_features, order)


def ttm_modes(rows: int, cols: int,
              order: int | None = None) -> tuple[Factorization, Factorization]:
    """Row and column modes of a TTM of the same order (rows = vocab or out_features)."""
    return _descending_then_ascending(rows, cols, order)


def _descending_then_ascending(first: int, second: int,
                               order: int | None) -> tuple[Factorization, Factorization]:
    """Both sizes factorized with one order: the first's modes descending, the second's
    ascending (what both chain layouts want, for the reasons their docstrings give)."""
    order = _resolve_order(order, first, second)
    one, two = factorize(first, order), factorize(second, order)
    return (Factorization(one.size, tuple(sorted(one.modes, reverse=True))),
            Factorization(two.size, tuple(sorted(two.modes))))
