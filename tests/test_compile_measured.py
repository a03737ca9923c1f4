"""The measured compile: training and inference calls raced compiled against eager, the
faster kept, and optimize's default never leaving a model slower than eager.

The races run on a fake clock (``clock``): a sleeping forward advances it by exactly its
seconds, so each race sees the periods it is given, whatever the machine's load."""

import subprocess
import sys

import pytest
import torch
from torch import nn

import comera_compile as cc
from comera_compile.compile.policy import measured, step_bound
from comera_compile.compile.policy.measured import (
    CLOSE_TRIALS,
    COMPILED,
    EAGER,
    KEEP,
    MARGIN,
    WARMUP,
    MeasuredCompile,
)
from comera_compile.training.trainer import is_compiled


class FakeTime:
    """``time`` for the measured compile: it stands still except when a call sleeps."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


CLOCK = FakeTime()


@pytest.fixture
def clock(monkeypatch):
    monkeypatch.setattr(measured, "time", CLOCK)
    monkeypatch.setattr(step_bound, "time", CLOCK)
    return CLOCK


class Sleeper(nn.Module):
    """Eager forward that takes ``seconds`` of the fake clock; the fake compiled form takes
    ``compiled``."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        CLOCK.sleep(self.seconds)
        return self.lin(x)


def _install(eager_s: float, compiled_s: float) -> tuple[Sleeper, list[str]]:
    """Use with the ``clock`` fixture."""
    model = Sleeper(eager_s)
    ran = []

    def compiled(x):
        ran.append(COMPILED)
        CLOCK.sleep(compiled_s)
        return model.lin(x)

    model._compiled_call_impl = MeasuredCompile(model, compiled, trials=3, wait_s=0.0)
    return model, ran


CALLS = WARMUP[COMPILED] + WARMUP[EAGER] + 2 * 3  # planned calls before the choice


@pytest.mark.parametrize("eager_s, compiled_s, choice", [(0.02, 0.005, COMPILED),
                                                         (0.005, 0.02, EAGER)])
def test_the_faster_form_is_kept_for_training(eager_s, compiled_s, choice, clock):
    model, ran = _install(eager_s, compiled_s)
    x = torch.randn(2, 4)
    for _ in range(CALLS + 5):
        model(x).sum().backward()
    race = model._compiled_call_impl.races["training"]
    assert race.choice == choice
    assert race.speedup == pytest.approx(eager_s / compiled_s)
    # after the choice every call runs in that form
    before = len(ran)
    for _ in range(4):
        model(x)
    assert (len(ran) - before == 4) == (choice == COMPILED)
    assert is_compiled(model) == (choice == COMPILED)
    assert choice in model._compiled_call_impl.describe()


def test_a_cpu_gain_under_the_keep_threshold_stays_eager_and_says_so(clock):
    model, ran = _install(0.02, 0.0175)  # about 1.14x faster compiled: under KEEP on CPU
    x = torch.randn(2, 4)
    for _ in range(CALLS + 2):
        model(x).sum().backward()
    race = model._compiled_call_impl.races["training"]
    assert race.keep == KEEP["cpu"] == 1.3
    assert race.speedup == pytest.approx(0.02 / 0.0175) and race.speedup < race.keep
    assert race.choice == EAGER
    assert not race.extended  # far enough from the threshold: decided after three trials
    assert "under the 1.30x it must gain to be kept" in model._compiled_call_impl.describe()


def test_a_ratio_close_to_the_threshold_is_timed_longer_before_the_choice(clock):
    model, ran = _install(0.026, 0.02)  # 1.3x: within CLOSE of KEEP on CPU
    x = torch.randn(2, 4)
    for _ in range(CALLS + 2 * CLOSE_TRIALS + 2):
        model(x).sum().backward()
    race = model._compiled_call_impl.races["training"]
    assert race.extended and race.choice is not None
    timed = [len(race.periods[m]) - WARMUP[m] for m in (COMPILED, EAGER)]
    assert min(timed) >= 3 + CLOSE_TRIALS  # the medians are over the longer race


def test_inference_is_raced_apart_and_evaluation_does_not_disturb_training(clock):
    model, ran = _install(0.02, 0.004)
    x = torch.randn(2, 4)
    for i in range(CALLS + 3):
        model.train()
        model(x).sum().backward()
        if i % 3 == 0:  # a periodic evaluation between training steps
            model.eval()
            with torch.no_grad():
                model(x)
    races = model._compiled_call_impl.races
    assert races["training"].choice == COMPILED
    assert races["inference"].choice is None  # too few inference calls yet
    assert "inference: being timed" in model._compiled_call_impl.describe()


def test_a_new_batch_shape_measures_again(clock):
    model, _ = _install(0.02, 0.004)
    for i in range(CALLS - 1):
        model(torch.randn(2 if i < CALLS - 2 else 3, 4))
    race = model._compiled_call_impl.races["training"]
    assert race.choice is None
    assert race.periods == {COMPILED: [], EAGER: []}


def test_a_compiler_failure_leaves_the_run_eager_and_says_why(caplog):
    model = Sleeper(0.0)

    def compiled(x):
        raise torch._dynamo.exc.BackendCompilerFailed(
            "comera", RuntimeError("AssertionError: For 16*s20, expected [s20]"), None)

    model._compiled_call_impl = MeasuredCompile(model, compiled, trials=3, wait_s=0.0)
    x = torch.randn(2, 4)
    for _ in range(CALLS + 2):  # the race's first compiled call fails; the run goes on
        torch.testing.assert_close(model(x), model.lin(x))
    impl = model._compiled_call_impl
    assert impl.races["training"].choice == EAGER and not is_compiled(model)
    assert impl.describe().startswith("eager: compiling failed (BackendCompilerFailed")
    assert "runs eager from now on" in caplog.text


@pytest.mark.slow
def test_optimize_default_compiles_measured_and_matches_eager():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
    x = torch.randn(16, 32)
    eager = cc.optimize(model, budget=0.3, example_inputs=(x,), compile=False)
    compiled = cc.optimize(model, budget=0.3, example_inputs=(x,))
    compiled.load_state_dict(eager.state_dict())
    assert isinstance(compiled._compiled_call_impl, MeasuredCompile)
    compiled._compiled_call_impl.wait_s = 0.0  # race at once (the wait has its own tests)
    proj = torch.randn(32)
    for _ in range(CALLS + 1):
        for m in (eager, compiled):
            m.zero_grad()
            (m(x) @ proj).square().mean().backward()
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)
    race = compiled._compiled_call_impl.races["training"]
    assert race.choice in (COMPILED, EAGER)
    assert race.keep == KEEP["cpu"]
    assert (race.choice == COMPILED) == (race.speedup >= race.keep)
    assert "training:" in cc.summary(compiled).compiled


def test_a_run_of_unknown_length_waits_eager_before_racing(clock):
    """Eager calls first, until they have taken ``wait_s``: a run shorter than that never
    compiles (so never pays a compile it cannot win back); then the race as before."""
    model, ran = _install(0.02, 0.005)
    impl = model._compiled_call_impl
    impl.wait_s = 0.3
    x = torch.randn(2, 4)
    model(x).sum().backward()
    assert impl.describe().startswith("training: eager until its calls have taken 0.3 s")
    steps = 1
    while impl.waited_s["training"] < 0.3:
        model(x).sum().backward()
        steps += 1
        assert steps < 100
    # 15 periods of 20 ms make 0.3 s (16 where the float sum falls short), the first uncounted
    assert not ran and steps in (16, 17)
    for _ in range(CALLS + 2):
        model(x).sum().backward()
    assert ran and impl.races["training"].choice == COMPILED


def test_the_wait_counts_training_periods_and_inference_calls_apart(clock):
    """An evaluation between two training calls voids that training period (it is not a
    training step's time); inference counts its calls' own durations."""
    model, ran = _install(0.02, 0.005)
    impl = model._compiled_call_impl
    impl.wait_s = 10.0
    x = torch.randn(2, 4)
    for _ in range(5):
        model.train()
        model(x).sum().backward()
        model.eval()
        with torch.no_grad():
            model(x)
    assert impl.waited_s["training"] == 0.0
    assert impl.waited_s["inference"] == pytest.approx(0.1)
    model.train()
    for _ in range(4):
        model(x).sum().backward()
    assert impl.waited_s["training"] == pytest.approx(0.06)
    assert not ran and "inference: eager until its calls have taken 10 s" in impl.describe()


def test_optimize_default_waits_with_the_device_rule_and_says_so():
    from comera_compile.compile.policy.measured import MAX_SPEEDUP, MIN_COMPILE_S, WAIT_S

    assert WAIT_S["cpu"] == pytest.approx(MIN_COMPILE_S / (1 - 1 / MAX_SPEEDUP["cpu"]))
    model = cc.optimize(nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 32)), 0.3,
                        example_inputs=(torch.randn(8, 32),))
    text = cc.summary(model).compiled
    assert f"training: eager until its calls have taken {WAIT_S['cpu']:.3g} s" in text
    for _ in range(3):
        model(torch.randn(8, 32)).sum().backward()
    impl = model._compiled_call_impl
    assert impl.wait_s == WAIT_S["cpu"] and not impl.has_compiled
    assert impl.races["training"].choice is None and not impl.races["training"].periods[COMPILED]


def test_compile_always_skips_the_measurement_and_bad_values_are_refused():
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
    x = torch.randn(4, 32)
    always = cc.optimize(model, budget=0.3, example_inputs=(x,), compile="always")
    assert not isinstance(always._compiled_call_impl, MeasuredCompile)
    assert is_compiled(always)
    with pytest.raises(ValueError, match="compile must be True, False or 'always'"):
        cc.optimize(model, budget=0.3, example_inputs=(x,), compile="auto")


@pytest.mark.parametrize("calls, compiles", [(50, False), (10**6, True)])
def test_a_first_compile_that_cannot_pay_before_the_shapes_change_is_not_made(calls, compiles,
                                                                             clock):
    """Told the shapes change after ``calls`` training calls, the race times eager first
    (one step profiled for its bound); 50 steps of 20 ms cannot save a first compile's
    cost, so nothing compiles and the summary says why; a long horizon races as before."""
    from comera_compile.compile.policy.measured import FIRST_COMPILE_S

    model, ran = _install(0.02, 0.005)
    impl = model._compiled_call_impl
    impl.shapes_change_after(calls)
    x = torch.randn(2, 4)
    with torch.no_grad():  # evaluation before training: eager until training compiles
        model.eval()(x)
    assert not ran
    model.train()
    for _ in range(CALLS + 8):
        model(x).sum().backward()
    race = impl.races["training"]
    assert bool(ran) == compiles
    if compiles:
        assert race.choice == COMPILED and is_compiled(model)
    else:
        assert race.choice == EAGER and not is_compiled(model)
        why = impl.describe()
        assert why.startswith("eager: the cores' shapes change in") and \
            f"about {FIRST_COMPILE_S:.0f} s" in why
    assert impl.bound is not None  # a sleeping step: little kept, a high bound


def test_a_profiled_bound_decides_by_the_saving_to_expect_not_the_most(clock):
    """With a profiled bound, a first compile must be expected to pay: ``REALIZED`` of the
    bound's removable time, in the share of the model that compiles, over the steps left,
    against a typical first compile. 300 steps of 0.5 s at a bound of 1.3x could save 50 s
    at the best speedup seen, but are expected to save about 10 s: they stay eager."""
    from comera_compile.compile.policy.measured import (
        FIRST_COMPILE_S,
        MAX_SPEEDUP,
        MIN_COMPILE_S,
        REALIZED,
        expected_speedup,
    )

    assert expected_speedup(2.0) == pytest.approx(1 / (1 - 0.5 * REALIZED))
    assert expected_speedup(2.0, 0.5) == pytest.approx(1 / (1 - 0.25 * REALIZED))
    assert expected_speedup(1.0) == 1.0
    model, _ = _install(0.0, 0.0)
    impl = model._compiled_call_impl
    impl.shapes_change_after(300)
    race = impl.races["training"]
    race.periods[EAGER] = [0.5] * (WARMUP[EAGER] + 3)
    assert 300 * 0.5 * (1 - 1 / MAX_SPEEDUP["cpu"]) >= MIN_COMPILE_S
    assert impl._why_not_compile(race, cuda=False) == ""  # unprofiled: the best case
    impl.bound = 1.3
    saved = 300 * 0.5 * (1 - 1 / expected_speedup(1.3))
    assert saved < FIRST_COMPILE_S
    why = impl._why_not_compile(race, cuda=False)
    assert f"expected to save {saved:.1f} s" in why and "at most 1.30x" in why
    impl.kept_s = 0.25  # profiled: the bound is the race's fastest eager step over it
    why = impl._why_not_compile(race, cuda=False)
    assert impl.bound == pytest.approx(2.0) and "at most 2.00x" in why
    impl.shapes_change_after(3000)  # ten times the steps: expected to pay
    assert impl._why_not_compile(race, cuda=False) == ""


def test_an_evaluation_voids_a_known_horizon_profile(clock):
    """The bound takes a profiled step and the unprofiled one after it; an evaluation
    between voids the profile, and the next steps take it again."""
    model, ran = _install(0.01, 0.001)
    model._compiled_call_impl = impl = MeasuredCompile(model, ran.append, trials=8)
    impl.shapes_change_after(10**6)
    x = torch.randn(2, 4)
    for _ in range(WARMUP[EAGER] + 1):  # the warm-up, then the first timed step
        model(x).sum().backward()
    assert impl._profile is not None
    with torch.no_grad():
        model.eval()(x)
    model.train()
    assert impl._profile is None and impl.bound is None
    assert not torch._C._autograd._profiler_enabled()
    for _ in range(4):  # a period's start, profiled, unprofiled: the bound
        model(x).sum().backward()
    assert not ran
    assert impl.bound is not None and impl.bound > 1.5  # the step mostly sleeps


@pytest.mark.parametrize("symbolic_ranks, horizon", [(None, 300), (True, 300), (False, 60)])
def test_a_rank_adaptive_trainer_of_known_length_announces_its_horizon(symbolic_ranks, horizon):
    """At symbolic ranks (by default where the run cuts ranks) a cut compiles nothing, so
    the graph serves the whole run; at static ranks, until the first cut (the early stage:
    a fifth of the run)."""
    from comera_compile.training import RankAdaptiveTrainer

    options = cc.CompileOptions(symbolic_ranks=symbolic_ranks)
    config = cc.CompressionConfig(budget=0.5, compile_options=options)
    model = cc.optimize(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)), config,
                        example_inputs=(torch.randn(8, 64),))
    impl = model._compiled_call_impl
    opt = torch.optim.AdamW(model.parameters())
    RankAdaptiveTrainer(model, opt, total_steps=300, target_ratio=0.5)
    assert impl.calls_before_change == horizon
    assert impl.cuts_recompile == (symbolic_ranks is False)
    assert impl.races["training"].plan[0] == EAGER


class _Row:
    def __init__(self, key, self_us, total_us, count=1):
        self.key, self.self_cpu_time_total, self.cpu_time_total = key, self_us, total_us
        self.count = count


def test_kept_time_is_matmuls_attention_convolutions_activations_and_the_optimizer():
    from comera_compile.compile.policy.step_bound import LAUNCH_US, kept_seconds, speedup_bound

    rows = [_Row("aten::mm", 40_000, 41_000), _Row("aten::addmm", 5_000, 6_000),
            _Row("aten::_scaled_dot_product_flash_attention_for_cpu_backward", 10_000, 12_000),
            _Row("Optimizer.step#AdamW.step", 100, 5_000), _Row("aten::add", 3_000, 3_000),
            _Row("aten::linear", 50, 47_000)]
    assert kept_seconds(rows) == pytest.approx(0.060)  # 40 + 5 + 10 ms self, 5 ms optimizer
    assert speedup_bound(0.080, kept_seconds(rows)) == pytest.approx(80 / 60)
    # a GELU's arithmetic is kept, its launches are not; many tiny calls keep nothing
    gelu = _Row("aten::gelu_backward", 9_000, 9_000, count=100)
    assert kept_seconds([*rows, gelu]) == pytest.approx(0.060 + (9_000 - 100 * LAUNCH_US) / 1e6)
    tiny = _Row("aten::silu", 500, 500, count=100)
    assert kept_seconds([*rows, tiny]) == pytest.approx(0.060)
    assert speedup_bound(0.080, 0.0) == float("inf")


@pytest.mark.parametrize("bound, wait_s", [(2.0, None), (1.25, 15.0 / (1 - 1 / 1.25)),
                                           (1.02, "eager")])
def test_the_profiled_bound_sets_the_wait_or_keeps_the_model_eager(bound, wait_s, clock):
    """A bound of 2x leaves the device's wait (its cap is MAX_SPEEDUP); 1.25x needs a
    longer wait to repay a first compile; 1.02x, under the margin, never compiles."""
    from comera_compile.compile.policy.measured import MIN_COMPILE_S, WAIT_S

    assert MIN_COMPILE_S == 15.0
    model, ran = _install(0.0, 0.0)
    impl = MeasuredCompile(model, lambda x: ran.append(COMPILED))
    impl._cuda = False  # calls ran on CPU; the wait is the rule's
    impl.kept_s = 0.100 / bound  # as a profiled step leaves it
    impl._read_bound(0.100)
    assert impl.bound == pytest.approx(bound)
    if wait_s == "eager":
        assert impl.races["training"].choice == EAGER
        assert "could gain at most 1.02x" in impl.describe()
    else:
        assert impl.wait_s == pytest.approx(wait_s or WAIT_S["cpu"])
        assert f"at most {bound:.2f}x faster compiled" in impl.describe()


def test_a_step_profile_ends_with_the_optimizer_step_and_counts_the_rest_as_kept(clock):
    """The profiler stops when the optimizer's step ends (the loop's own work runs
    unprofiled) and that work counts as kept time: a long one brings the bound to 1."""
    from comera_compile.compile.policy.step_bound import StepProfile

    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    model.register_forward_hook(lambda *_: clock.sleep(0.05))  # the profiled step: 50 ms
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(32, 64)
    assert StepProfile.available()
    profile = StepProfile()
    assert torch._C._autograd._profiler_enabled() and not StepProfile.available()
    model(x).square().mean().backward()
    assert torch._C._autograd._profiler_enabled()
    opt.step()
    assert not torch._C._autograd._profiler_enabled() and profile.end is not None
    window = profile.end - profile.start
    assert window == pytest.approx(0.05)
    clock.sleep(0.2)  # the loop's own work, unprofiled
    period = clock.perf_counter() - profile.start
    assert 1.0 < profile.bound(period) < 1.0 + window / 0.2
    opt.step()  # the hook is gone with the profile
    assert not torch._C._autograd._profiler_enabled()


def test_a_profile_left_running_at_exit_is_stopped():
    """torch's profiler left running crashes the interpreter at exit; a step profile
    whose optimizer step and next call never came is stopped first."""
    code = "from comera_compile.compile.policy.step_bound import StepProfile\nStepProfile()\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_step_spent_in_matmuls_is_profiled_once_and_never_compiles(clock, monkeypatch):
    """A step whose time is nearly all in kernels a compiled step calls as eager does (99 of
    its 100 ms in matmuls, as the profile reads it): the first profiled step keeps the model
    eager for good."""
    monkeypatch.setattr(step_bound, "kept_seconds", lambda rows: 0.099)
    model = Sleeper(0.1)
    ran = []
    model._compiled_call_impl = impl = MeasuredCompile(model, lambda x: ran.append(x))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(2, 4)
    for _ in range(4):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert impl.bound == pytest.approx(0.1 / 0.099) and impl.bound < MARGIN
    assert not ran and impl.describe().startswith("eager: a compiled step could gain at most")


def test_no_profile_is_taken_while_the_user_profiles(clock):
    model, ran = _install(0.001, 0.001)
    impl = MeasuredCompile(model, lambda x: ran.append(x))
    model._compiled_call_impl = impl
    x = torch.randn(2, 4)
    with torch.profiler.profile():
        for _ in range(4):
            model(x).sum().backward()
    assert impl.bound is None and impl._profile is None and not ran
