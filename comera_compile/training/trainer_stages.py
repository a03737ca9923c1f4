"""The trainer's stage control: the rank terms of each stage, the switch to the late stage,
the size budget it follows and when that budget is checked."""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor

from comera_compile.training.schedule import EARLY, LATE, SizeTargetSchedule, size_weight

TARGET_TOLERANCE = 0.05
"""``target_reached``: the size is within this share of ``S_t``, above or below."""

SWITCH_SLACK = 0.01
"""A size this share above its budget counts as met: the size floor holds it just above,
and waiting for ``S <= S_t`` exactly would keep the task loss at a tenth of its weight."""


class StageControl:
    """The stage half of ``RankAdaptiveTrainer``: targets, schedule and switch rule."""

    def rank_terms(self) -> tuple[Tensor | float, Tensor]:
        """``(w, extra)`` with this step's objective ``w * task_loss + extra``."""
        self._ensure_tensors()
        if self._stage == EARLY:
            weight, extra = 1.0, self.penalty_weight * self.bank.penalty()
        elif self.schedule is not None:
            weight, extra = 1.0, 0.01 * (self.bank.soft_size() / self._size_norm)
        else:
            size_term = self.bank.soft_size() / self._size_norm
            weight, extra = 1.1 - self._lam, (0.01 + self._lam) * size_term
        if self.l2_weight:
            extra = extra + self.l2_weight * self.bank.core_l2()
        return weight, extra

    def start_late_stage(self, counts: list[int] | None = None) -> None:
        """Switch to the late stage now: prune (unless ``prune_every=None``), then fix
        ``S_t``, ``L_t``, the R scale and the budget schedule."""
        counts = self._read()[0] if counts is None else counts
        if self.prune_every:
            self._prune_if_worth_it(counts, required=False)
        self.size_start = self._size_of(counts)
        self.size_target = self._size_goal()
        if self.task_target is not None:
            self.task_loss_target = float(self.task_target)
        elif self.plateau.ema is not None:
            self.task_loss_target = float(self.plateau.ema)
        else:
            raise RuntimeError("no task loss seen yet: call loss() before the late stage starts")
        floor = self._size_of([min(self.min_rank, c) for c in counts])
        if self.size_target < floor:
            warnings.warn(f"size target {self.size_target:,.0f} is below what the model weighs at "
                          f"min_rank={self.min_rank} ({floor:,}): layers left dense and biases set "
                          "the floor; tensorize more layers or raise the target", stacklevel=2)
        if self.total_steps is not None:
            self.schedule = SizeTargetSchedule.for_run(
                self.steps, self.total_steps, self.size_start, self.size_target,
                self.settle_fraction,
            )
        self._ensure_tensors()
        with torch.no_grad():
            self._size_norm.copy_(self.bank.soft_size().clamp(min=1e-12))
        self._stage = LATE

    def budget(self, step: int | None = None) -> float | None:
        """The late stage's size aim at ``step`` (now by default): the schedule's, else ``S_t``."""
        if self._stage != LATE:
            return None
        step = self.steps if step is None else step
        return self.schedule(step) if self.schedule is not None else self.size_target

    @property
    def target_gap(self) -> float | None:
        """``S / S_t - 1`` in the late stage (0: on target; -0.1: 10% below), else None."""
        if self._stage != LATE:
            return None
        return self.size() / self.size_target - 1.0

    @property
    def target_reached(self) -> bool:
        """In the late stage, ``S`` is within ``TARGET_TOLERANCE`` of ``S_t`` either way, or,
        where one channel is a larger step, within half a channel of it."""
        if self._stage != LATE:
            return False
        counts = self._counts
        units = self._units() or [1] * len(self.bank.layers)
        steps = [self.bank.cost_per_channel(counts, b) * units[self.bank.bond_layer[b]]
                 for b in range(len(self.bank))]
        slack = max(TARGET_TOLERANCE * self.size_target, max(steps, default=0) / 2)
        return abs(self.size() - self.size_target) <= slack

    def size_floor(self) -> float | None:
        """The size threshold deaths may not take the model below: the budget in the late
        stage, the target itself in the early stage."""
        return self.budget() if self._stage == LATE else self._size_goal()

    def _size_goal(self) -> float:
        if self.target_bytes is not None:
            return float(self.target_bytes)
        if self.target_params is not None:
            return float(self.target_params)
        return self.target_ratio * self._size_initial

    def _budget_check_due(self) -> bool:
        """Prune points and, under a schedule, ten points over its span, its end and the last
        step: meeting the budget only switches channels off, so it may follow closely."""
        every = self.prune_every
        if self.schedule is None:
            return bool(every) and self.steps % every == 0
        span = max(1, (self.schedule.end - self.schedule.begin) // 10)
        if (every and self.steps % every == 0) or (self.steps - self.schedule.begin) % span == 0:
            return True
        return self.steps in (self.schedule.end, self.total_steps)

    def _prune_due(self) -> bool:
        """Every ``prune_every`` steps, and where the final shapes are due."""
        if not self.prune_every:
            return False
        return self.steps % self.prune_every == 0 or self._final_shapes_due()

    def _final_shapes_due(self) -> bool:
        """The schedule's end and the run's last step: the rest trains at the final size."""
        ends = (self.schedule.end if self.schedule is not None else None, self.total_steps)
        return self._stage == LATE and self.steps in ends

    def _switch(self, task_loss: float | None, size: int) -> float:
        """The paper's switch rule, against the current budget."""
        if task_loss is None or not math.isfinite(task_loss):
            return self.lam  # a non-finite loss says nothing about the gap: keep the choice
        budget = self.budget(self.steps + 1)
        if size <= budget * (1 + SWITCH_SLACK):
            return 0.0
        return size_weight(task_loss, self.task_loss_target, size, budget)
