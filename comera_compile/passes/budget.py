"""Budget: how small the optimized model must be, as one config object."""

from __future__ import annotations

import re
from dataclasses import dataclass

ACCEPTED = (
    "None (tensorize every eligible layer), a float in (0, 1] (fraction of the parameters to "
    "keep), an int (parameter count), a string of bytes ('20MB', '512KiB', '1.5GB'), a "
    "percentage ('5%'), a ratio ('40x'), or Budget(params=, bytes=, flops=, ratio=, fraction=)"
)

SMALLEST_INT_BUDGET = 100
"""Bare int budgets up to this are refused (``Budget(params=N)`` states a count)."""

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Budget:
    """Limits the optimized model must meet; every limit given must hold.

    params: total parameter count. bytes: total parameter bytes (int, or "20MB").
    flops: forward multiply-adds at the example input shape (needs example_inputs); a float
    in (0, 1] is a share of the dense model's (0.5 -> half the multiply-adds).
    ratio: a compression ratio, original parameters / new parameters at least this
    (40 -> 40x smaller, the same as fraction=0.025). Not a share to keep.
    fraction: the share of parameters to keep, new / original at most this (0.05 -> 5%);
    the rank-adaptive trainer's ``target_ratio`` is such a share too.
    """

    params: int | None = None
    bytes: int | str | None = None
    flops: int | float | None = None
    ratio: float | None = None
    fraction: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.bytes, str):
            object.__setattr__(self, "bytes", parse_bytes(self.bytes))
        for name in ("params", "bytes", "flops", "ratio", "fraction"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not value > 0):
                raise ValueError(f"Budget.{name} must be positive, got {value!r}")
        if self.fraction is not None and self.fraction > 1:
            raise ValueError(f"Budget.fraction is a share of the model in (0, 1], got "
                             f"{self.fraction}; use ratio= for 'N times smaller'")
        if all(getattr(self, n) is None for n in ("params", "bytes", "flops", "ratio", "fraction")):
            raise ValueError(f"Budget needs at least one limit; accepted forms: {ACCEPTED}")

    def limits(self, params: int, nbytes: int, macs: int | None) -> dict[str, float]:
        """Absolute caps ``{"params": .., "bytes": .., "macs": ..}`` for a model of this size."""
        caps: dict[str, float] = {}
        for cap in (self.params,
                    None if self.ratio is None else params / self.ratio,
                    None if self.fraction is None else params * self.fraction):
            if cap is not None:
                caps["params"] = min(caps.get("params", cap), cap)
        if self.bytes is not None:
            caps["bytes"] = self.bytes
        if self.flops is not None:
            if macs is None:
                raise ValueError("a flops budget needs example_inputs: multiply-adds depend "
                                 "on the input shape")
            share = isinstance(self.flops, float) and self.flops <= 1
            caps["macs"] = self.flops * macs if share else self.flops
        return caps

    def __str__(self) -> str:
        given = [f"{n}={getattr(self, n)!r}" for n in
                 ("params", "bytes", "flops", "ratio", "fraction") if getattr(self, n) is not None]
        return f"Budget({', '.join(given)})"


def parse_bytes(text: str) -> int:
    """``"20MB"`` -> 20_000_000, ``"512KiB"`` -> 524_288, ``"1.5GB"`` -> 1_500_000_000."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ValueError(f"cannot read budget {text!r}; accepted forms: {ACCEPTED}")
    return int(float(match.group(1)) * _UNITS[unit])


def parse_budget(budget: object) -> Budget | None:
    """Turn any accepted budget form into a ``Budget`` (None stays None)."""
    if budget is None or isinstance(budget, Budget):
        return budget
    if isinstance(budget, bool):
        raise ValueError(f"cannot read budget {budget!r}; accepted forms: {ACCEPTED}")
    if isinstance(budget, int):
        if 0 < budget <= SMALLEST_INT_BUDGET:
            raise ValueError(
                f"budget={budget} is an int, read as a parameter count ({budget} "
                f"parameter{'s' * (budget != 1)} for the whole model). For a share to keep "
                f"pass a float (budget={budget / 100!r} or '{budget}%'; budget=1.0 keeps "
                f"everything); for {budget} times smaller pass '{budget}x' or "
                f"Budget(ratio={budget}); for a count this small, Budget(params={budget})"
            )
        return Budget(params=budget)
    if isinstance(budget, float):
        if not 0 < budget <= 1:
            raise ValueError(f"a float budget is the fraction of parameters to keep, in (0, 1]; "
                             f"got {budget}. Accepted forms: {ACCEPTED}")
        return Budget(fraction=budget)
    if isinstance(budget, str):
        text = budget.strip().lower()
        try:
            if text.endswith("%"):
                return Budget(fraction=float(text[:-1]) / 100)
            if text.endswith("x"):
                return Budget(ratio=float(text[:-1]))
        except ValueError:
            raise ValueError(f"cannot read budget {budget!r}; accepted forms: {ACCEPTED}") from None
        return Budget(bytes=parse_bytes(budget))
    raise ValueError(f"cannot read budget {budget!r}; accepted forms: {ACCEPTED}")
