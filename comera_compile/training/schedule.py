"""The two stages of CoMERA training and the rules that move between them. Late stage: the
switch rule ``0.1 L + 0.01 R + lam R + (1 - lam) L`` or, where the run's length is known, a
size budget that tightens on a cubic schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torch import Tensor

EARLY, LATE = "early", "late"


def size_weight(task_loss: float, task_target: float, size: float, size_target: float) -> float:
    """``lam = 1[(L - L_t) / L < (S - S_t) / S]``: 1 when size is relatively further off."""
    task_gap = (task_loss - task_target) / max(task_loss, 1e-12)
    size_gap = (size - size_target) / max(size, 1e-12)
    return 1.0 if task_gap < size_gap else 0.0


def late_stage_loss(task_loss: Tensor, size_term: Tensor, lam: float | Tensor) -> Tensor:
    """The reference's late-stage objective for one step (``lam`` may be a 0-d tensor)."""
    return 0.1 * task_loss + 0.01 * size_term + lam * size_term + (1.0 - lam) * task_loss


@dataclass
class SizeTargetSchedule:
    """The size target over the late stage: ``start`` at ``begin``, ``target`` from ``end``
    on (a size in bytes or parameters, not a compression ``Budget``)."""

    begin: int
    end: int
    start: float
    target: float

    @classmethod
    def for_run(cls, begin: int, total_steps: int, start: float, target: float,
                settle_fraction: float) -> SizeTargetSchedule:
        """The size target of a late stage from step ``begin`` to ``total_steps``."""
        span = max(1, math.ceil((total_steps - begin) * (1.0 - settle_fraction)))
        return cls(begin, min(begin + span, total_steps), float(start), float(target))

    def __call__(self, step: int) -> float:
        """``target + (start - target) * (1 - progress) ** 3``, progress clamped to [0, 1]."""
        progress = min(max((step - self.begin) / max(self.end - self.begin, 1), 0.0), 1.0)
        return self.target + (self.start - self.target) * (1.0 - progress) ** 3


class Plateau:
    """EMA of the task loss, and whether it has stopped improving."""

    def __init__(self, patience: int | None = None, beta: float = 0.98, min_delta: float = 1e-3):
        self.patience, self.beta, self.min_delta = patience, beta, min_delta
        self.ema: float | None = None
        self.best = float("inf")
        self.since_best = 0
        self.count = 0

    def update(self, value: float) -> bool:
        """Fold in one loss value; return True when the loss has plateaued."""
        if not math.isfinite(value):
            return False
        self.count += 1
        if self.ema is None:
            self.ema = value
        else:
            self.ema = self.beta * self.ema + (1 - self.beta) * value
        # The EMA is biased towards its first value for ~1/(1-beta) steps; don't judge yet.
        if self.count < 1 / (1 - self.beta):
            return False
        if self.ema < self.best * (1 - self.min_delta):
            self.best, self.since_best = self.ema, 0
        else:
            self.since_best += 1
        return self.patience is not None and self.since_best >= self.patience

    def state_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        vars(self).update(state)
