"""Keep the compiled forward only where it pays: a few calls timed both ways.

Whether inductor beats eager depends on the model, the batch and the machine (on a CPU a
compiled step without dropout can be slower than eager), and no rule known before running
says which. So ``optimize(compile=True)`` installs :class:`MeasuredCompile` as the model's
compiled call. It times whole steps, from one call to the next of the same kind (for
training: forward, loss, backward, optimizer step and whatever else the loop does),
compiled and eager in turn, then keeps the faster for the rest of the run. Training calls
(``model.training`` with grad enabled) and other calls (evaluation, inference) are raced
apart, since they compile to different graphs. The choices and the measured ratios are
in ``summary(model)``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

COMPILED, EAGER = "compiled", "eager"
TRAINING, INFERENCE = "training", "inference"

MARGIN = 1.05
"""The compiled step must be this much faster to be kept: a recompile (a new batch-size
region, a pruned rank) costs seconds, so a gain within timing noise is not worth it."""

WARMUP = {COMPILED: 2, EAGER: 1}
"""Untimed calls per mode: the first compiled call compiles (for training: its forward,
then its backward), the second still settles; eager's first call plans its contractions."""


def _on_cuda(args: tuple, kwargs: dict) -> bool:
    return any(isinstance(v, torch.Tensor) and v.is_cuda for v in (*args, *kwargs.values()))


def _shapes(args: tuple, kwargs: dict) -> tuple:
    values = (*args, *kwargs.values())
    return tuple(tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in values)


class Race:
    """One kind of call timed compiled and eager in turn until each has ``trials`` periods
    past its warm-up; then ``choice`` is the faster (compiled only if ``MARGIN`` faster)."""

    def __init__(self, trials: int) -> None:
        self.trials = trials
        self.choice: str | None = None
        self.speedup: float | None = None
        self.gain_s = 0.0  # seconds a compiled call saves over an eager one
        self.compile_s = 0.0  # seconds the first compile cost, past the compiled call's time
        self.periods: dict[str, list[float]] = {COMPILED: [], EAGER: []}
        self.plan = [COMPILED] * WARMUP[COMPILED] + [EAGER] * WARMUP[EAGER]
        self.last: tuple[str, float, tuple] | None = None  # (mode, start, input shapes)

    def next_mode(self, shapes: tuple) -> str:
        """The mode this call runs in, recording the period the previous call ended."""
        now = time.perf_counter()
        if self.last is not None and self.last[2] == shapes:
            self.periods[self.last[0]].append(now - self.last[1])
        elif self.last is not None:  # another input shape: its times are not comparable
            self.periods = {COMPILED: [], EAGER: []}
        if self._measured():
            self._decide()
            return self.choice
        if not self.plan:
            self.plan = [EAGER, COMPILED]
        mode = self.plan.pop(0)
        self.last = (mode, time.perf_counter(), shapes)
        return mode

    def _measured(self) -> bool:
        return all(len(self.periods[m]) >= WARMUP[m] + self.trials for m in self.periods)

    def _decide(self) -> None:
        eager = statistics.median(self.periods[EAGER][WARMUP[EAGER]:])
        compiled = statistics.median(self.periods[COMPILED][WARMUP[COMPILED]:])
        self.speedup = eager / compiled
        self.gain_s = eager - compiled
        warm = self.periods[COMPILED][:WARMUP[COMPILED]]
        self.compile_s = max(0.0, sum(warm) - len(warm) * compiled)
        self.choice = COMPILED if self.speedup >= MARGIN else EAGER
        self.last = None


class MeasuredCompile:
    """A model's call that races its compiled and eager forms (training and inference
    apart) and then runs the faster; see the module docstring."""

    def __init__(self, model: nn.Module, compiled: Callable[..., Any], trials: int = 3) -> None:
        self.model, self.compiled, self.trials = model, compiled, trials
        self.races = {TRAINING: Race(trials), INFERENCE: Race(trials)}
        self.eager_why = ""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        training = self.model.training and torch.is_grad_enabled()
        race = self.races[TRAINING if training else INFERENCE]
        if race.choice is None and _on_cuda(args, kwargs):
            torch.cuda.synchronize()  # CUDA runs ahead of the host: time finished work only
        mode = race.choice or race.next_mode(_shapes(args, kwargs))
        if mode == COMPILED:
            return self.compiled(*args, **kwargs)
        return self.model._call_impl(*args, **kwargs)

    def why_not_recompile(self, calls_left: int) -> str:
        """Why recompiling the training graph (a cut changes its shapes) would not pay, or
        "" if it would: the compiled step's measured gain over ``calls_left`` more training
        calls must cover the recompile, taken to cost what the first compile did."""
        race = self.races[TRAINING]
        if race.choice is None:
            return ""
        if race.choice == EAGER:
            return "training already runs eager"
        if calls_left * race.gain_s >= race.compile_s:
            return ""
        return (f"a cut changes the cores' shapes, and its recompile (the first took "
                f"{race.compile_s:.0f} s) would not be paid back by the compiled step's gain "
                f"({race.gain_s * 1e3:.0f} ms a step) over the {calls_left} steps left")

    def run_eager(self, why: str) -> None:
        """Run every call eager from now on (a recompile would not pay), saying ``why``."""
        for race in self.races.values():
            race.choice, race.last = EAGER, None
        self.eager_why = why

    @property
    def compiles_training(self) -> bool:
        """Whether training steps run compiled (until the race ends: yes)."""
        return self.races[TRAINING].choice != EAGER

    def describe(self) -> str:
        """What runs and why, for ``summary``."""
        if self.eager_why:
            return f"eager: {self.eager_why}"
        parts = []
        for kind, race in self.races.items():
            if race.choice is None:
                parts.append(f"{kind}: being timed compiled against eager (the first "
                             f"{WARMUP[COMPILED] + WARMUP[EAGER] + 2 * self.trials} calls)")
            elif race.choice == COMPILED:
                parts.append(f"{kind}: compiled, {race.speedup:.2f}x eager's step")
            else:
                parts.append(f"{kind}: eager, the compiled step measured {race.speedup:.2f}x "
                             f"eager's (under the {MARGIN:.2f}x it must gain)")
        return "; ".join(parts)
