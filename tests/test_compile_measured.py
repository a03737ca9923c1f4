"""The measured compile: training and inference calls raced compiled against eager, the
faster kept, and optimize's default never leaving a model slower than eager."""

import time

import pytest
import torch
from torch import nn

import comera_compile as cc
from comera_compile.compile.measured import COMPILED, EAGER, MARGIN, WARMUP, MeasuredCompile
from comera_compile.training.trainer import is_compiled


class Sleeper(nn.Module):
    """Eager forward that takes ``seconds``; the fake compiled form takes ``compiled``."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        time.sleep(self.seconds)
        return self.lin(x)


def _install(eager_s: float, compiled_s: float) -> tuple[Sleeper, list[str]]:
    model = Sleeper(eager_s)
    ran = []

    def compiled(x):
        ran.append(COMPILED)
        time.sleep(compiled_s)
        return model.lin(x)

    model._compiled_call_impl = MeasuredCompile(model, compiled, trials=3)
    return model, ran


CALLS = WARMUP[COMPILED] + WARMUP[EAGER] + 2 * 3  # planned calls before the choice


@pytest.mark.parametrize("eager_s, compiled_s, choice", [(0.02, 0.005, COMPILED),
                                                         (0.005, 0.02, EAGER)])
def test_the_faster_form_is_kept_for_training(eager_s, compiled_s, choice):
    model, ran = _install(eager_s, compiled_s)
    x = torch.randn(2, 4)
    for _ in range(CALLS + 5):
        model(x).sum().backward()
    race = model._compiled_call_impl.races["training"]
    assert race.choice == choice
    assert race.speedup == pytest.approx(eager_s / compiled_s, rel=0.5)
    # after the choice every call runs in that form
    before = len(ran)
    for _ in range(4):
        model(x)
    assert (len(ran) - before == 4) == (choice == COMPILED)
    assert is_compiled(model) == (choice == COMPILED)
    assert choice in model._compiled_call_impl.describe()


def test_inference_is_raced_apart_and_evaluation_does_not_disturb_training():
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


def test_a_new_batch_shape_measures_again():
    model, _ = _install(0.02, 0.004)
    for i in range(CALLS - 1):
        model(torch.randn(2 if i < CALLS - 2 else 3, 4))
    race = model._compiled_call_impl.races["training"]
    assert race.choice is None
    assert race.periods == {COMPILED: [], EAGER: []}


@pytest.mark.slow
def test_optimize_default_compiles_measured_and_matches_eager():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
    x = torch.randn(16, 32)
    eager = cc.optimize(model, budget=0.3, example_inputs=(x,), compile=False)
    compiled = cc.optimize(model, budget=0.3, example_inputs=(x,))
    compiled.load_state_dict(eager.state_dict())
    assert isinstance(compiled._compiled_call_impl, MeasuredCompile)
    proj = torch.randn(32)
    for _ in range(CALLS + 1):
        for m in (eager, compiled):
            m.zero_grad()
            (m(x) @ proj).square().mean().backward()
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)
    race = compiled._compiled_call_impl.races["training"]
    assert race.choice in (COMPILED, EAGER)
    assert (race.choice == COMPILED) == (race.speedup >= MARGIN)
    assert "training:" in cc.summary(compiled).compiled


def test_compile_always_skips_the_measurement_and_bad_values_are_refused():
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
    x = torch.randn(4, 32)
    always = cc.optimize(model, budget=0.3, example_inputs=(x,), compile="always")
    assert not isinstance(always._compiled_call_impl, MeasuredCompile)
    assert is_compiled(always)
    with pytest.raises(ValueError, match="compile must be True, False or 'always'"):
        cc.optimize(model, budget=0.3, example_inputs=(x,), compile="auto")


@pytest.mark.parametrize("calls, compiles", [(50, False), (10**6, True)])
def test_a_first_compile_that_cannot_pay_before_the_shapes_change_is_not_made(calls, compiles):
    """Told the shapes change after ``calls`` training calls, the race times eager first;
    50 steps of 20 ms cannot save a first compile's cost even at the best speedup, so
    nothing compiles and the summary says why; a long horizon races as before."""
    from comera_compile.compile.measured import MIN_COMPILE_S

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
            f"{MIN_COMPILE_S:.0f} s" in why


def test_a_rank_adaptive_trainer_of_known_length_announces_its_first_cut():
    from comera_compile.training import RankAdaptiveTrainer

    model = cc.optimize(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)), 0.5,
                        example_inputs=(torch.randn(8, 64),))
    impl = model._compiled_call_impl
    opt = torch.optim.AdamW(model.parameters())
    RankAdaptiveTrainer(model, opt, total_steps=300, target_ratio=0.5)
    assert impl.calls_before_change == 60  # the early stage: a fifth of the run
    assert impl.races["training"].plan[0] == EAGER
