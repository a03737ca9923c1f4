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

When the run will change the graph's shapes soon (a rank-adaptive trainer of known length
cuts ranks once its early stage ends, :meth:`MeasuredCompile.shapes_change_after`), a
first compile may not pay before its graph is thrown away: on a 2-core CPU a training
graph's first compile took 28-64 s (``python benchmarks/compiled.py``, "compile s") for
steps at most 1.44x faster. So eager steps are timed first, and the model compiles only if
the most a compiled step could save (``1 - 1 / MAX_SPEEDUP`` of the eager step) over the
steps before that change covers ``MIN_COMPILE_S``; otherwise it stays eager and says why.
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

MAX_SPEEDUP = {"cpu": 1.5, "cuda": 4.0}
"""The most a compiled training step has gained over eager, with room (measured: 1.44x on
a 2-core CPU, ``benchmarks/results/compiled.md``; 2.7x on one H200, ``compiled_cuda.md``)."""

MIN_COMPILE_S = 15.0
"""What a training graph's first compile costs at the least: about half the fastest measured
from an empty cache (28 s on a 2-core CPU, ``benchmarks/results/compiled.md``), leaving room
for faster machines. Gains under this cannot pay for compiling."""

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

    def __init__(self, trials: int, eager_first: bool = False) -> None:
        self.trials = trials
        self.choice: str | None = None
        self.speedup: float | None = None
        self.gain_s = 0.0  # seconds a compiled call saves over an eager one
        self.compile_s = 0.0  # seconds the first compile cost, past the compiled call's time
        self.periods: dict[str, list[float]] = {COMPILED: [], EAGER: []}
        if eager_first:  # eager timed before anything compiles
            self.plan = [EAGER] * (WARMUP[EAGER] + trials) + [COMPILED] * WARMUP[COMPILED]
        else:
            self.plan = [COMPILED] * WARMUP[COMPILED] + [EAGER] * WARMUP[EAGER]
        self.last: tuple[str, float, tuple] | None = None  # (mode, start, input shapes)

    def eager_step(self) -> float | None:
        """The median timed eager period so far (None before any is timed)."""
        timed = self.periods[EAGER][WARMUP[EAGER]:]
        return statistics.median(timed) if timed else None

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
        self.calls_before_change: int | None = None  # training calls until shapes change
        self.training_calls = 0
        self.has_compiled = False  # whether a training call has run compiled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        training = self.model.training and torch.is_grad_enabled()
        if not training and self.calls_before_change is not None and (
                self.races[TRAINING].choice != COMPILED):
            # cuts are coming: evaluation compiles only once training has compiled
            return self.model._call_impl(*args, **kwargs)
        race = self.races[TRAINING if training else INFERENCE]
        if race.choice is None and _on_cuda(args, kwargs):
            torch.cuda.synchronize()  # CUDA runs ahead of the host: time finished work only
        mode = race.choice or race.next_mode(_shapes(args, kwargs))
        if training:
            self.training_calls += 1
            if mode == COMPILED and not self.has_compiled:
                why = self._why_not_compile(race, _on_cuda(args, kwargs))
                if why:
                    self.run_eager(why)
                    mode = EAGER
        if mode == COMPILED:
            self.has_compiled = self.has_compiled or training
            return self.compiled(*args, **kwargs)
        return self.model._call_impl(*args, **kwargs)

    def shapes_change_after(self, calls: int) -> None:
        """Tell the race that the training graph's shapes change after ``calls`` more
        training calls (a rank cut). Before anything compiles, eager steps are timed first,
        and the first compile happens only if it can pay before then (module docstring)."""
        self.calls_before_change = self.training_calls + max(0, int(calls))
        race = self.races[TRAINING]
        if not self.has_compiled and race.choice is None and race.last is None:
            self.races[TRAINING] = Race(self.trials, eager_first=True)

    def _why_not_compile(self, race: Race, cuda: bool) -> str:
        """Why a first compile cannot pay before the shapes change, or "" if it may."""
        eager = race.eager_step()
        if self.calls_before_change is None or eager is None:
            return ""
        calls = self.calls_before_change - self.training_calls
        most = calls * eager * (1 - 1 / MAX_SPEEDUP["cuda" if cuda else "cpu"])
        if most >= MIN_COMPILE_S:
            return ""
        return (f"the cores' shapes change in {max(calls, 0)} steps, and a compiled step "
                f"could save at most {most:.1f} s over them (eager's step: "
                f"{eager * 1e3:.0f} ms), under what a first compile costs "
                f"(>= {MIN_COMPILE_S:.0f} s)")

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
