"""Validation helpers shared by the format modules: fail at the door with a fix."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence


def as_modes(modes: Sequence[int], name: str) -> list[int]:
    """Return ``modes`` as a list of positive ints, or raise naming the bad entry."""
    try:
        out = [int(m) for m in modes]
    except TypeError as exc:
        raise TypeError(f"{name} must be a sequence of positive ints, got {modes!r}") from exc
    if not out:
        raise ValueError(f"{name} is empty; pass at least one mode (e.g. factorize(size, 1))")
    if any(m < 1 for m in out) or any(m != mm for m, mm in zip(out, modes)):
        raise ValueError(f"{name} must contain positive ints, got {list(modes)!r}")
    return out


def as_rank_list(rank: int | Sequence[int], count: int, name: str = "rank") -> list[int]:
    """Expand an int rank to ``count`` internal ranks, or check a given list of them."""
    if isinstance(rank, numbers.Integral):
        ranks = [int(rank)] * count
    else:
        ranks = [int(r) for r in rank]
        if len(ranks) != count:
            raise ValueError(
                f"{name} lists {len(ranks)} internal ranks but the chain has {count} bonds; "
                f"pass one int or exactly {count} ints (not the boundary 1s)"
            )
    if any(r < 1 for r in ranks):
        raise ValueError(f"{name} must be >= 1, got {rank!r}")
    return ranks


def check_full_ranks(ranks: Sequence[int], num_cores: int) -> list[int]:
    """Check a full rank list ``[1, r_1, ..., r_{L-1}, 1]`` for a chain of ``num_cores``."""
    out = [int(r) for r in ranks]
    if len(out) != num_cores + 1:
        raise ValueError(
            f"ranks has {len(out)} entries but {num_cores} cores need {num_cores + 1} "
            f"([1, r_1, ..., r_{num_cores - 1}, 1]); build it with clip_ranks(dims, rank)"
        )
    if out[0] != 1 or out[-1] != 1:
        raise ValueError(f"ranks must start and end with 1, got {out}")
    if any(r < 1 for r in out):
        raise ValueError(f"ranks must be >= 1, got {out}")
    return out


def as_int(value: object, name: str) -> int:
    """Return ``value`` as an int >= 1 (numpy ints accepted), or raise naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


def prod(values: Sequence[int]) -> int:
    """Integer product (1 for an empty sequence)."""
    return math.prod(int(v) for v in values)
