"""Pruning a compiled model: a cut is a recompile, so a compiled model is cut only when a
third of its cores are dead and where the run needs its final shapes, and still ends at
its target."""

import math

import pytest
import torch
from models import small_tt_model, toy_classes, train_steps

from comera_compile.training import LATE, RankAdaptiveTrainer, param_groups
from comera_compile.training.trainer import COMPILED_MIN_CUT, is_compiled

pytestmark = pytest.mark.usefixtures("one_thread")


def _run(compiled: bool, steps: int = 90, ratio: float = 0.3):
    x, y = toy_classes(64)
    model = small_tt_model()
    if compiled:  # the trainer only asks whether the model runs compiled; eager is faster here
        model._compiled_call_impl = lambda *a, **k: model._call_impl(*a, **k)
    assert is_compiled(model) == compiled
    opt = torch.optim.AdamW(param_groups(model, lr_cores=1e-2, lr_gates=1e-3, lr_rest=1e-2))
    trainer = RankAdaptiveTrainer(model, opt, early_steps=20, prune_every=5,
                                  target_ratio=ratio, total_steps=steps)
    shapes, changes = [p.shape for p in model.parameters()], 0
    for _ in range(steps):
        train_steps(model, opt, trainer, x, y, 1)
        now = [p.shape for p in model.parameters()]
        changes += now != shapes
        shapes = now
    return model, trainer, changes


def test_compiled_model_is_cut_a_few_times_and_still_ends_at_its_target():
    eager_model, eager, eager_changes = _run(compiled=False)
    model, trainer, changes = _run(compiled=True)
    assert changes == trainer.cuts
    # each optional cut removes a third or more; the budget's end and the run's end may add one
    bound = math.ceil(math.log(1 / 0.3) / math.log(1 / (1 - COMPILED_MIN_CUT))) + 2
    assert 1 <= changes <= bound
    assert changes < eager_changes
    for t in (eager, trainer):
        assert t.stage == LATE and t.target_reached
    assert model[0].ranks == model[0].effective_ranks()  # the final shapes are cut
    assert trainer.dead_share() == 0.0


def test_dead_share_counts_what_a_cut_would_remove():
    model = small_tt_model()
    opt = torch.optim.AdamW(model.parameters())
    trainer = RankAdaptiveTrainer(model, opt, total_steps=10)
    assert trainer.dead_share() == 0.0
    stored = sum(p.numel() for layer in (model[0], model[2]) for p in (*layer.cores,
                                                                         *layer.gates))
    with torch.no_grad():
        model[0].gates[0][:2] = 0.0  # two of the first bond's 4 channels
    counts = [int(c) for c in trainer.bank.alive_counts().tolist()]
    r = model[0].ranks
    lost = 2 * (4 * r[0] + 4 * r[2]) + 2  # both cores beside the bond, and two gate entries
    assert trainer.dead_share(counts) == pytest.approx(lost / stored)


def _measured(model, compile_s: float, gain_s: float):
    """A measured compile whose training race is already decided: compiled, with the given
    first-compile cost and gain per step (the compiled call itself runs eager here)."""
    from comera_compile.compile.policy.measured import COMPILED, TRAINING, MeasuredCompile

    impl = MeasuredCompile(model, lambda *a, **k: model._call_impl(*a, **k))
    race = impl.races[TRAINING]
    race.choice, race.speedup, race.compile_s, race.gain_s = COMPILED, 1.5, compile_s, gain_s
    model._compiled_call_impl = impl
    return impl


@pytest.mark.parametrize("compile_s, stays_compiled", [(60.0, False), (0.001, True)])
def test_a_cut_whose_recompile_would_not_pay_back_runs_the_model_eager(compile_s,
                                                                        stays_compiled):
    """90 steps that save 1 ms each cannot pay for a 60 s recompile: at the first cut the
    model goes eager (and is then cut like an eager model); a cheap recompile keeps it
    compiled and cut rarely."""
    x, y = toy_classes(64)
    model = small_tt_model()
    impl = _measured(model, compile_s, gain_s=1e-3)
    assert is_compiled(model)
    opt = torch.optim.AdamW(param_groups(model, lr_cores=1e-2, lr_gates=1e-3, lr_rest=1e-2))
    trainer = RankAdaptiveTrainer(model, opt, early_steps=20, prune_every=5,
                                  target_ratio=0.3, total_steps=90)
    train_steps(model, opt, trainer, x, y, 90)
    assert trainer.target_reached and trainer.cuts >= 1
    assert is_compiled(model) == stays_compiled
    if stays_compiled:
        assert impl.describe().startswith("training: compiled")
    else:
        why = impl.describe()
        assert why.startswith("eager: from step ") and "60 s" in why and "1 ms" in why
        assert impl.why_not_recompile(10**6) == "training already runs eager"
    _, compiled, _ = _run(compiled=True)  # compiled throughout: cut only a few times
    if stays_compiled:
        assert trainer.cuts == compiled.cuts
    else:  # eager from the first cut on: cut at every prune point with dead channels
        assert trainer.cuts > compiled.cuts
