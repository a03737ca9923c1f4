"""Keep the compiled forward only where it pays: a few calls timed both ways. Whether inductor
beats eager depends on the model, the batch and the machine, and no rule known before running
says which (docs/compile.md)."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from comera_compile.compile.policy.blocks import shared_blocks, why_not_blocks
from comera_compile.compile.policy.rank_dims import SymbolicRanks, symbolic_layers
from comera_compile.compile.policy.step_bound import StepProfile, speedup_bound
from comera_compile.nn import TensorizedLayer

log = logging.getLogger("comera_compile")

COMPILED, EAGER = "compiled", "eager"
TRAINING, INFERENCE = "training", "inference"

MARGIN = 1.05
"""The least a compiled step must gain: a recompile costs seconds, so a gain within timing
noise is not worth it (a profiled bound under it never compiles)."""

KEEP = {"cpu": 1.3, "cuda": MARGIN}  # calibration: docs/cpu-performance.md
"""How much faster the raced compiled step must be for the run to keep it: on CPU a race's
ratio comes out above the steady one and later recompiles are costly; on CUDA they are
cheap."""

CLOSE, CLOSE_TRIALS = 0.1, 4  # calibration: docs/cpu-performance.md
"""A race whose ratio lands within ``CLOSE`` of ``KEEP`` times ``CLOSE_TRIALS`` more calls of
each mode before it decides: one model's races have landed either side of ``KEEP``."""

MAX_SPEEDUP = {"cpu": 1.5, "cuda": 4.0}  # calibration: docs/cpu-performance.md
"""The most a compiled training step has gained over eager, with room."""

MIN_COMPILE_S = 15.0  # calibration: docs/cpu-performance.md
"""What a training graph's first compile costs at the least (about half the fastest
measured, for faster machines): gains under this cannot pay for compiling."""

REALIZED = 0.3  # calibration: docs/cpu-performance.md
"""The share of a profiled step's removable time (``compile.policy.step_bound``) a compiled
CPU step is expected to remove: the low end of what was measured, since a compile that
does not pay leaves the run slower than eager."""

FIRST_COMPILE_S = 30.0  # calibration: docs/cpu-performance.md
"""What a first compile of a training graph is expected to cost on CPU, set against what
compiling is expected to save where a profiled bound is known."""


def expected_speedup(bound: float, compiled_share: float = 1.0) -> float:
    """The step speedup to expect where a profiled step's ``bound`` is known: ``REALIZED``
    of its removable time removed, in the ``compiled_share`` of the model that compiles."""
    removed = (1 - 1 / bound) * REALIZED * compiled_share
    return 1 / (1 - removed)


def wait_for(best: float) -> float:
    """Eager seconds over which steps that a compiled step would run ``best`` times faster
    give up what the cheapest first compile costs (``MIN_COMPILE_S``)."""
    return MIN_COMPILE_S / (1 - 1 / best)


WAIT_S = {device: wait_for(best) for device, best in MAX_SPEEDUP.items()}
"""Eager seconds of calls (training and inference apart) before a run of unknown length
starts racing, where no profiled bound is known (``MeasuredCompile.wait_s`` sets one)."""

WARMUP = {COMPILED: 2, EAGER: 1}
"""Untimed calls per mode: the first compiled call compiles (for training: its forward,
then its backward), the second still settles; eager's first call plans its contractions."""


def _recompiles(form: Callable[..., Any], model: nn.Module | None = None) -> bool:
    """Whether a rank cut recompiles ``form`` (the blocks, or the whole ``model``): its
    ranks are static, or it traces a tensorized layer whose ranks stay static."""
    if not isinstance(form, SymbolicRanks) or not form.enabled:
        return True
    scope = getattr(form, "compiled_blocks", None) or [model]
    symbolic = {id(m) for part in scope for m in symbolic_layers(part)}
    return any(isinstance(m, TensorizedLayer) and id(m) not in symbolic
               for part in scope for m in part.modules())


def _on_cuda(args: tuple, kwargs: dict) -> bool:
    return any(isinstance(v, torch.Tensor) and v.is_cuda for v in (*args, *kwargs.values()))


def _shapes(args: tuple, kwargs: dict) -> tuple:
    values = (*args, *kwargs.values())
    return tuple(tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in values)


class Race:
    """One kind of call timed compiled and eager in turn until each has ``trials`` periods
    past its warm-up; then ``choice`` is the faster (compiled only if ``keep`` times faster:
    ``KEEP`` of the device the calls run on)."""

    def __init__(self, trials: int, eager_first: bool = False) -> None:
        self.trials = trials
        self.keep = MARGIN  # set to the device's KEEP by the first call
        self.extended = False  # whether a close ratio has had its extra trials
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
        """The fastest timed eager period so far (None before any is timed): noise only
        adds time, and a run's first steps are its slowest."""
        timed = self.periods[EAGER][WARMUP[EAGER]:]
        return min(timed) if timed else None

    def next_mode(self, shapes: tuple) -> str:
        """The mode this call runs in, recording the period the previous call ended."""
        now = time.perf_counter()
        if self.last is not None and self.last[2] == shapes:
            self.periods[self.last[0]].append(now - self.last[1])
        elif self.last is not None:  # another input shape: its times are not comparable
            self.periods = {COMPILED: [], EAGER: []}
        if self._measured() and self._decide():
            return self.choice
        if not self.plan:
            self.plan = [EAGER, COMPILED]
        mode = self.plan.pop(0)
        self.last = (mode, time.perf_counter(), shapes)
        return mode

    def _measured(self) -> bool:
        return all(len(self.periods[m]) >= WARMUP[m] + self.trials for m in self.periods)

    def _decide(self) -> bool:
        """Choose from the medians, or return False to time ``CLOSE_TRIALS`` more calls of
        each mode where the ratio is within ``CLOSE`` of ``keep`` (once)."""
        eager = statistics.median(self.periods[EAGER][WARMUP[EAGER]:])
        compiled = statistics.median(self.periods[COMPILED][WARMUP[COMPILED]:])
        self.speedup = eager / compiled
        if abs(self.speedup - self.keep) < CLOSE and not self.extended:
            self.extended = True
            self.trials += CLOSE_TRIALS
            return False
        self.gain_s = eager - compiled
        warm = self.periods[COMPILED][:WARMUP[COMPILED]]
        self.compile_s = max(0.0, sum(warm) - len(warm) * compiled)
        self.choice = COMPILED if self.speedup >= self.keep else EAGER
        self.last = None
        return True


class MeasuredCompile:
    """A model's call that races its compiled and eager forms (training and inference
    apart) and then runs the faster; see the module docstring."""

    def __init__(self, model: nn.Module, compiled: Callable[..., Any], trials: int = 3,
                 wait_s: float | None = None, blocks: SymbolicRanks | None = None,
                 blocks_required: bool = False, symbolic_ranks: bool | None = None) -> None:
        self.model, self.compiled, self.trials = model, compiled, trials
        self.blocks = blocks  # the model's blocks compiled (compile.policy.blocks), where they pay
        self.blocks_required = blocks_required  # blocks=True: blocks whatever the rule
        self.symbolic_ranks = symbolic_ranks  # None: symbolic where the run cuts ranks
        self._whole_why = ""  # why the default did not take the model's blocks
        self._form: Callable[..., Any] | None = None  # what compiled calls run, once chosen
        self.cuts_expected = False  # whether the run will cut ranks (expect_cuts)
        self.races = {TRAINING: Race(trials), INFERENCE: Race(trials)}
        self.eager_why = ""
        self.calls_before_change: int | None = None  # training calls until shapes change
        self._horizon = "the cores' shapes change"  # what ends the graph's use then
        self.training_calls = 0
        self.has_compiled = False  # whether a training call has run compiled
        self._wait_set = wait_s  # None: by the rule (the device, the profiled bound)
        self.bound: float | None = None  # the compiled step's best speedup (step_bound)
        self._cuda: bool | None = None  # where the calls run, once one has
        self._profile: StepProfile | None = None  # the step being profiled for the bound
        self.kept_s: float | None = None  # the profiled step's time in kept kernels
        self._profiled_s: float | None = None  # the profiled step's own period
        self.waited_s = {TRAINING: 0.0, INFERENCE: 0.0}  # eager seconds counted so far
        self._training_start: float | None = None  # the last training call's start

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        training = self.model.training and torch.is_grad_enabled()
        kind = TRAINING if training else INFERENCE
        if not training:
            self._void_training_period()
        if not training and self.calls_before_change is not None and (
                self.races[TRAINING].choice != COMPILED):
            # cuts are coming: evaluation compiles only once training has compiled
            return self.model._call_impl(*args, **kwargs)
        race = self.races[kind]
        cuda = _on_cuda(args, kwargs)
        if race.choice is None and cuda:
            torch.cuda.synchronize()  # CUDA runs ahead of the host: time finished work only
        self._cuda = cuda
        race.keep = KEEP["cuda" if cuda else "cpu"]
        if race.choice is None and self._waiting(kind):
            return self._wait_eager(training, args, kwargs)
        mode = race.choice or race.next_mode(_shapes(args, kwargs))
        if training:
            self.training_calls += 1
            if mode == COMPILED and not self.has_compiled:
                why = self._why_not_compile(race, cuda)
                if why:
                    self.run_eager(why)
                    mode = EAGER
            elif mode == EAGER and not self.has_compiled and race.choice is None:
                self._eager_training_call(time.perf_counter())  # a known horizon's bound
        if mode == COMPILED:
            self.has_compiled = self.has_compiled or training
            try:
                return self.compiled_form(*args, **kwargs)
            except torch._dynamo.exc.BackendCompilerFailed as error:  # inductor's among them
                # the compiler failed on a graph of this call (nothing of that graph ran;
                # graphs before it in the call may have, so their buffer updates, e.g.
                # BatchNorm's statistics, happen once more): the default must not stop a
                # run that eager trains, so this call and every later one run eager
                first = (str(error).strip().splitlines() or [""])[-1][:200]
                self.run_eager(f"compiling failed ({type(error).__name__}: {first})")
                log.warning("compiling failed; the model runs eager from now on: %s", first)
        return self.model._call_impl(*args, **kwargs)

    @property
    def compiled_form(self) -> Callable[..., Any]:
        """What compiled calls run, fixed at the first: ranks symbolic if asked or where the run
        will cut ranks; the model's blocks where they pay (``blocks.why_not_blocks``) unless, at
        static ranks, the run cuts (each cut block would be a graph of its own); else the whole
        model."""
        if self._form is None:
            cuts = self.cuts_expected or self.calls_before_change is not None
            symbolic = cuts if self.symbolic_ranks is None else self.symbolic_ranks
            self.compiled.enabled = symbolic
            self._form = self.compiled
            if self.blocks is not None:
                self.blocks.enabled = symbolic
                why = "" if self.blocks_required else why_not_blocks(self.blocks.blocks,
                                                                     symbolic)
                if not why and cuts and not symbolic and not self.blocks_required:
                    why = "the run cuts ranks, and cut blocks would each be a graph"
                self._whole_why = why
                self._form = self.compiled if why else self.blocks
                if not why and not self.blocks_required:
                    self.blocks.select(shared_blocks(self.blocks.blocks, symbolic))
        return self._form

    @property
    def cuts_recompile(self) -> bool:
        """Whether a rank cut changes the compiled graphs' shapes: their ranks are static,
        or a tensorized layer they trace keeps static ranks (an embedding table;
        ``compile.policy.rank_dims``)."""
        return _recompiles(self.compiled_form, self.model)

    @property
    def wait_s(self) -> float:
        """Eager seconds each kind of call runs before the race (module docstring): set,
        or by the rule, ``WAIT_S`` of the device lengthened to the profiled bound's
        ``wait_for`` (on CPU before any call)."""
        if self._wait_set is not None:
            return self._wait_set
        best = MAX_SPEEDUP["cuda" if self._cuda else "cpu"]
        return wait_for(min(best, self.bound)) if self.bound is not None else wait_for(best)

    @wait_s.setter
    def wait_s(self, seconds: float) -> None:
        self._wait_set = seconds

    def _waiting(self, kind: str) -> bool:
        """Whether calls of this kind still run eager before racing: a run of unknown
        length (a known one decides by ``shapes_change_after``) short of ``wait_s``."""
        return self.calls_before_change is None and self.waited_s[kind] < self.wait_s

    def _wait_eager(self, training: bool, args: tuple, kwargs: dict) -> Any:
        """One eager call of the wait, counted: a training period runs from this training
        call's start to the next one's (the step's backward and optimizer included); an
        inference call counts its own duration and voids the training period around it."""
        start = time.perf_counter()
        if training:
            self.training_calls += 1
            if self._training_start is not None:
                self.waited_s[TRAINING] += start - self._training_start
            self._eager_training_call(start)
            return self.model._call_impl(*args, **kwargs)
        self._void_training_period()
        out = self.model._call_impl(*args, **kwargs)
        self.waited_s[INFERENCE] += time.perf_counter() - start
        return out

    def _eager_training_call(self, start: float) -> None:
        """An eager training call starts at ``start``, ending the period of the one before. A
        profiled period gives the time compiled code keeps, the next unprofiled one the step's
        time (the profiler slows what it records): together, the bound
        (``compile.policy.step_bound``)."""
        if self._training_start is not None:
            period = start - self._training_start
            if self._profile is not None:
                profile, self._profile = self._profile, None
                self.kept_s, self._profiled_s = profile.kept(period), period
                del profile  # freed here: reading and freeing the profile is no step's time
                start = time.perf_counter()
            elif self.kept_s is not None and self.bound is None:
                self._read_bound(period)
            elif self.bound is None and not self._cuda and StepProfile.available():
                self._profile = StepProfile()  # profiled on CPU only
                start = self._profile.start  # the profiled period starts here
        self._training_start = start

    def _void_training_period(self) -> None:
        """A call that is not a training step (an evaluation) ends no period."""
        self._training_start = None
        if self._profile is not None:
            self._profile.stop()
            self._profile = None

    def _read_bound(self, period: float) -> None:
        """The bound from an unprofiled period and the kept time profiled before it: it
        lengthens the wait (``wait_s``), decides a known horizon's first compile
        (``_why_not_compile``) or, under ``MARGIN``, keeps the model eager for good."""
        steps = [t for t in (period, self._profiled_s) if t is not None]
        self.bound = speedup_bound(min(steps), self.kept_s)  # noise only adds time
        if self.bound < MARGIN:
            self.run_eager(
                f"a compiled step could gain at most {self.bound:.2f}x (under the "
                f"{MARGIN:.2f}x it must gain): {1 / self.bound:.0%} of an eager step is in "
                "matrix products, attention, convolutions, transcendental activations, the "
                "optimizer and the loop's own work, which compiled code runs as eager does "
                "(compile.policy.step_bound)")

    @property
    def compiled_share(self) -> float:
        """The share of the model's blocks that compiled calls run compiled (1 where the
        whole model compiles)."""
        form = self.compiled_form
        compiled = getattr(form, "compiled_blocks", None)
        return len(compiled) / len(form.blocks) if compiled else 1.0

    @property
    def whole_why(self) -> str:
        """Why compiled calls run the whole model though it has blocks ("" otherwise)."""
        return self._whole_why

    def expect_cuts(self) -> None:
        """Tell the compile that the run will cut ranks (when, unknown): by default its
        graphs then keep ranks symbolic (``compiled_form``)."""
        self.cuts_expected = True

    def shapes_change_after(self, calls: int) -> None:
        """Tell the race that the training graph's shapes change after ``calls`` more
        training calls (a rank cut). Before anything compiles, eager steps are timed first,
        and the first compile happens only if it can pay before then (module docstring)."""
        self.calls_before_change = self.training_calls + max(0, int(calls))
        race = self.races[TRAINING]
        if not self.has_compiled and race.choice is None and race.last is None:
            self.races[TRAINING] = Race(self.trials, eager_first=True)

    def run_ends_after(self, calls: int) -> None:
        """Tell the race that the run ends after ``calls`` more training calls (its graph
        serves them all: cuts compile nothing, ``cuts_recompile``). As
        ``shapes_change_after``: the first compile happens only if it can pay by then."""
        self.shapes_change_after(calls)
        self._horizon = "the run ends"

    def _why_not_compile(self, race: Race, cuda: bool) -> str:
        """Why a first compile cannot pay before the shapes change, or "" if it may."""
        eager = race.eager_step()
        if self.calls_before_change is None or eager is None:
            return ""
        calls = self.calls_before_change - self.training_calls
        if self.bound is not None:  # profiled: what a compile is expected to save
            # the race's fastest eager step over the profiled kept time: steadier than
            # the one period the bound was first read from
            self.bound = speedup_bound(eager, self.kept_s) if self.kept_s else self.bound
            share = self.compiled_share
            speedup = expected_speedup(self.bound, share)
            saved = calls * eager * (1 - 1 / speedup)
            if saved >= FIRST_COMPILE_S:
                return ""
            part = "" if share == 1 else f" in the {share:.0%} of its blocks that compile"
            return (f"{self._horizon} in {max(calls, 0)} steps, and a compiled step is "
                    f"expected to save {saved:.1f} s over them (eager's step: "
                    f"{eager * 1e3:.0f} ms, at most {self.bound:.2f}x faster compiled; "
                    f"{REALIZED:.0%} of that gain{part}), under what a first compile "
                    f"costs (about {FIRST_COMPILE_S:.0f} s)")
        best = MAX_SPEEDUP["cuda" if cuda else "cpu"]
        most = calls * eager * (1 - 1 / best)
        if most >= MIN_COMPILE_S:
            return ""
        return (f"{self._horizon} in {max(calls, 0)} steps, and a compiled step "
                f"could save at most {most:.1f} s over them (eager's step: "
                f"{eager * 1e3:.0f} ms), under what a first compile costs "
                f"(>= {MIN_COMPILE_S:.0f} s)")

    def why_not_recompile(self, calls_left: int) -> str:
        """Why recompiling the training graph (a cut changes its shapes) would not pay, or
        "" if it would (or a cut compiles nothing: ``cuts_recompile``): the compiled step's
        measured gain over ``calls_left`` more training calls must cover the recompile,
        taken to cost what the first compile did."""
        race = self.races[TRAINING]
        if race.choice is None or (race.choice == COMPILED and not self.cuts_recompile):
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
            if race.choice is None and self._waiting(kind):
                known = self._cuda is not None or self._wait_set is not None
                wait = (f"{self.wait_s:.3g} s" if known else
                        f"{WAIT_S['cpu']:.3g} s (CPU; {WAIT_S['cuda']:.3g} s on CUDA)")
                bound = (f"; its step, at most {self.bound:.2f}x faster compiled"
                         if self.bound is not None and kind == TRAINING else "")
                parts.append(f"{kind}: eager until its calls have taken {wait} "
                             f"({self.waited_s[kind]:.0f} s so far), then timed compiled "
                             "against eager: a first compile costs at least "
                             f"{MIN_COMPILE_S:.0f} s, more than a shorter run could save{bound}")
            elif race.choice is None:
                parts.append(f"{kind}: being timed compiled against eager (the first "
                             f"{WARMUP[COMPILED] + WARMUP[EAGER] + 2 * self.trials} calls)")
            elif race.choice == COMPILED:
                what = f" (the whole model: {self.whole_why})" if self.whole_why else ""
                if self._form is not None and self._form is self.blocks:
                    what = f" ({self.blocks.describe()})"
                parts.append(f"{kind}: compiled{what}, {race.speedup:.2f}x eager's step")
            else:
                parts.append(f"{kind}: eager, the compiled step measured {race.speedup:.2f}x "
                             f"eager's (under the {race.keep:.2f}x it must gain to be kept)")
        return "; ".join(parts)
