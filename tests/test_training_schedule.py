"""Rank adaptation within the run's length: the budget schedule, channel removal when the
size lags, dead channels that stay dead, and a held-out run that ends at its target."""

import pytest
import torch
import torch.nn.functional as F
from models import small_tt_model, toy_classes, train_steps
from torch import nn

import comera_compile
from comera_compile.nn import TTLinear
from comera_compile.training import (
    LATE,
    GateBank,
    RankAdaptiveTrainer,
    SizeTargetSchedule,
    param_groups,
    rank_penalty,
    size_weight,
    soft_size,
)
from comera_compile.training.pruning import channel_scores, choose_removals

pytestmark = pytest.mark.usefixtures("one_thread")


def small_model(seed=0):
    return small_tt_model(seed)


def data(seed=1, n=64):
    return toy_classes(n, seed)


# ----- the schedule ------------------------------------------------------------------------
def test_budget_is_cubic_from_start_to_target_then_flat():
    s = SizeTargetSchedule.for_run(400, 800, start=1000.0, target=200.0, settle_fraction=0.25)
    assert (s.begin, s.end) == (400, 700)
    assert s(0) == s(400) == 1000.0
    assert s(550) == pytest.approx(200 + 800 / 8)  # halfway: (1 - 1/2) ** 3 of the slack
    assert s(700) == s(800) == s(10**6) == 200.0
    budgets = [s(t) for t in range(400, 701)]
    assert all(a >= b for a, b in zip(budgets, budgets[1:]))  # never loosens


def test_run_length_from_epochs_and_bad_lengths_name_the_fix():
    model = small_model()
    opt = torch.optim.AdamW(model.parameters())
    t = RankAdaptiveTrainer(model, opt, early_steps=10, epochs=3, steps_per_epoch=7)
    assert t.total_steps == 21
    with pytest.raises(ValueError, match="lower early_steps"):
        RankAdaptiveTrainer(model, opt, early_steps=30, total_steps=20)
    with pytest.raises(ValueError, match="go together"):
        RankAdaptiveTrainer(model, opt, epochs=3)
    with pytest.raises(ValueError, match="not both"):
        RankAdaptiveTrainer(model, opt, total_steps=5, epochs=1, steps_per_epoch=5)


def test_short_run_tracks_the_budget_and_ends_at_target():
    x, y = data()
    model = small_model()
    bank = GateBank(model)
    channel = max(bank.cost_per_channel(bank.sizes(), b) for b in range(len(bank)))
    opt = torch.optim.AdamW(param_groups(model, lr_cores=1e-2, lr_gates=1e-3, lr_rest=1e-2))
    trainer = RankAdaptiveTrainer(
        model, opt, early_steps=30, prune_every=10, target_ratio=0.4, total_steps=90
    )
    train_steps(model, opt, trainer, x, y, 90)
    h = trainer.history
    assert trainer.stage == LATE and trainer.target_reached
    assert abs(trainer.size() - trainer.size_target) <= 0.05 * trainer.size_target
    for r in h.records:
        if r["stage"] == LATE and r["pruned"]:  # after each prune point: on the budget
            assert r["params"] <= r["budget"] + channel / 2  # at most half a channel over
            assert r["params"] >= r["budget"] - channel / 2  # and never a channel under
    assert h.column("budget")[-1] == trainer.size_target
    assert model[0].ranks == model[0].effective_ranks()  # cores really shrank
    losses = h.column("task_loss")
    assert sum(losses[-5:]) / 5 < 0.7 * losses[0]  # the task still learned


def test_prune_every_none_reaches_the_target_without_changing_shapes():
    """For wrappers that fix shapes (FSDP): channels are switched off, never cut."""
    x, y = data()
    model = small_model()
    shapes = [p.shape for p in model.parameters()]
    opt = torch.optim.AdamW(param_groups(model, lr_cores=1e-2, lr_gates=1e-3, lr_rest=1e-2))
    trainer = RankAdaptiveTrainer(
        model, opt, early_steps=20, prune_every=None, target_ratio=0.4, total_steps=60
    )
    train_steps(model, opt, trainer, x, y, 60)
    assert trainer.target_reached
    assert [p.shape for p in model.parameters()] == shapes
    assert model[0].effective_ranks() != model[0].ranks


# ----- which channels go -------------------------------------------------------------------
def test_removal_takes_the_smallest_energy_shares_and_stops_at_the_excess():
    layer = TTLinear(16, 12, ranks=4, in_modes=[4, 4], out_modes=[3, 4]).double()
    with torch.no_grad():
        layer.cores[1][..., 2] *= 1e-3  # channel 2 of bond 2 carries almost nothing
        layer.cores[2][1] *= 1e-2  # channel 1 of bond 2 carries little
    bank = GateBank(layer)
    counts = [int(c) for c in bank.alive_counts().tolist()]
    assert counts == [4, 4, 4] and bank.sizes() == counts
    scores = torch.cat(channel_scores(bank)).tolist()
    cost = bank.cost_per_channel(counts, 1)
    assert cost == 1 + 4 * 4 + 3 * 4  # core 1 (mode 4, left rank 4), core 2 (mode 3, right 4)
    chosen = choose_removals(bank, scores, counts, excess=cost + 1, min_rank=1)
    assert chosen == {1: [2]} and counts == [4, 3, 4]  # a second would overshoot by 28 for 1
    counts = bank.sizes()
    chosen = choose_removals(bank, scores, counts, excess=cost + cost // 2 + 1, min_rank=1)
    assert chosen == {1: [2, 1]} and counts == [4, 2, 4]  # nearer the budget with both
    # the host size arithmetic agrees with the layer's own count at those ranks
    assert bank.layer_parameters(counts)[0] == layer.num_core_parameters([1, 4, 2, 4, 1]) + 10


def test_removal_keeps_min_rank_per_bond():
    layer = TTLinear(16, 12, ranks=4, in_modes=[4, 4], out_modes=[3, 4]).double()
    bank = GateBank(layer)
    counts = bank.sizes()
    scores = torch.cat(channel_scores(bank)).tolist()
    choose_removals(bank, scores, counts, excess=10**9, min_rank=2)
    assert counts == [2, 2, 2] and bank.sizes() == [4, 4, 4]


# ----- dead stays dead ---------------------------------------------------------------------
def _flips(history_of_alive):
    """How many (entry, step) pairs went from dead to alive."""
    flips = 0
    for before, after in zip(history_of_alive, history_of_alive[1:]):
        flips += int((~before & after).sum())
    return flips


def _alive(model):
    return torch.cat([g.detach().abs() > 0.01 for g in GateBank(model).gates])


def test_dead_channels_stay_dead_where_adamw_alone_brings_them_back():
    x, y = data()

    def setup():
        model = small_model()
        opt = torch.optim.AdamW(param_groups(model, lr_cores=1e-2, lr_gates=5e-2, lr_rest=1e-2))
        return model, opt

    # a hand loop with the penalty alone: momentum carries gates through zero and back
    model, opt = setup()
    alive = [_alive(model)]
    for _ in range(60):
        loss = F.cross_entropy(model(x), y) + rank_penalty(model, weight=1.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        alive.append(_alive(model))
    assert _flips(alive) > 0

    model, opt = setup()
    trainer = RankAdaptiveTrainer(
        model, opt, early_steps=None, prune_every=None, penalty_weight=1.0
    )
    alive = [_alive(model)]
    for _ in range(60):
        train_steps(model, opt, trainer, x, y, 1)
        alive.append(_alive(model))
    assert _flips(alive) == 0 and int((~alive[-1]).sum()) > 0
    gates = GateBank(model).gates
    dead = [g.detach().abs() <= 0.01 for g in gates]
    for g, d in zip(gates, dead):
        assert torch.all(g.detach()[d] == 0)  # frozen at exactly zero
        assert torch.all(opt.state[g]["exp_avg"][d] == 0)  # with no momentum left


# ----- the paper's run keeps the switch rule -----------------------------------------------
def test_without_run_length_the_late_stage_is_the_switch_rule_alone():
    x, y = data()
    model = small_model()
    opt = torch.optim.AdamW(param_groups(model))
    trainer = RankAdaptiveTrainer(model, opt, early_steps=5, prune_every=5, target_ratio=0.2)
    train_steps(model, opt, trainer, x, y, 20)
    assert trainer.schedule is None and trainer.budget() == trainer.size_target
    assert trainer.size() == trainer.size_start  # 15 slow steps: nothing is forced off
    late = trainer.history.records[4:]  # the late stage starts at step 5
    assert [r["stage"] for r in late] == [LATE] * 16 and trainer.history[3]["lam"] is None
    for r in late:  # each step's lam is the switch rule on that step's loss and size
        want = size_weight(r["task_loss"], trainer.task_loss_target, r["params"], r["budget"])
        assert r["lam"] == want


def test_late_stage_terms_with_lam_tensor_match_the_paper_mix():
    x, y = data()
    model = small_model()
    opt = torch.optim.AdamW(param_groups(model))
    trainer = RankAdaptiveTrainer(model, opt, early_steps=1, prune_every=None)
    train_steps(model, opt, trainer, x, y, 2)
    task = F.cross_entropy(model(x), y)
    size_term = soft_size(model) / trainer._size_norm
    lam = trainer.lam
    expected = 0.1 * task + 0.01 * size_term + lam * size_term + (1 - lam) * task
    torch.testing.assert_close(trainer.loss(task), expected)


# ----- a held-out run as a new user would make it ------------------------------------------
def breast_cancer():
    sklearn = pytest.importorskip("sklearn")
    del sklearn
    from sklearn.datasets import load_breast_cancer
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    x, y = load_breast_cancer(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.3, stratify=y, random_state=0
    )
    scaler = StandardScaler().fit(x_train)
    as_x = lambda a: torch.tensor(scaler.transform(a), dtype=torch.float32)  # noqa: E731
    return as_x(x_train), torch.tensor(y_train), as_x(x_test), torch.tensor(y_test)


@pytest.mark.slow
def test_held_out_mlp_reaches_its_target_in_800_steps():
    x, y, x_test, y_test = breast_cancer()
    torch.manual_seed(0)
    dense = nn.Sequential(
        nn.Linear(30, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 2)
    )
    model = comera_compile.optimize(dense, budget=0.3, compile=False)
    opt = torch.optim.AdamW(param_groups(model))  # the paper's learning rates
    trainer = RankAdaptiveTrainer(
        model, opt, target_ratio=0.3, early_steps=400, prune_every=50, total_steps=800
    )
    before = {n: p.numel() for n, p in model.named_parameters()}
    train_steps(model, opt, trainer, x, y, 800)
    assert trainer.target_reached
    assert trainer.size() <= 0.3 * trainer.size_start
    after = {n: p.numel() for n, p in model.named_parameters()}
    shrunk = [n for n in before if after[n] < before[n]]
    assert len(shrunk) >= 6  # cores and gates of both tensorized layers
    assert sum(after.values()) <= 0.35 * sum(before.values())
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    assert accuracy > 0.92  # dense reaches about 0.95 on this split
    losses = trainer.history.column("task_loss")
    # the loss held: at or under where the late stage found it (0.042 then, 0.006 at the end)
    assert sum(losses[-10:]) / 10 < trainer.task_loss_target


# ----- composes with captured steps --------------------------------------------------------
def test_rank_terms_trace_as_one_graph_and_lam_is_an_input_not_a_constant():
    x, y = data()
    model = small_model()
    opt = torch.optim.AdamW(param_groups(model))
    trainer = RankAdaptiveTrainer(model, opt, early_steps=1, prune_every=None)
    train_steps(model, opt, trainer, x, y, 2)
    graphs = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    # fullgraph: a host sync (.item(), float(), bool() of a tensor) would fail the trace
    loss = torch.compile(lambda task: trainer.loss(task), backend=count, fullgraph=True)
    task = torch.tensor(0.7, dtype=torch.float64)
    values = {}
    for lam in (1.0, 0.0, 1.0):
        trainer._lam.fill_(lam)
        values[lam] = loss(task)
        torch.testing.assert_close(values[lam], trainer.loss(task))
    assert len(graphs) == 1
    assert values[0.0] < values[1.0]  # lam = 1 weighs R (about 1 here) over the task loss 0.7


def test_one_host_transfer_per_step_and_none_in_loss(monkeypatch):
    x, y = data()
    model = small_model()
    opt = torch.optim.AdamW(param_groups(model))
    trainer = RankAdaptiveTrainer(model, opt, early_steps=3, prune_every=None, total_steps=900)
    train_steps(model, opt, trainer, x, y, 4)  # into the late stage; no budget check at steps 5, 6
    reads = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    for _ in range(2):  # late-stage steps, between budget checks
        task = F.cross_entropy(model(x), y)
        reads.clear()
        loss = trainer.loss(task)
        assert reads == []
        opt.zero_grad()
        loss.backward()
        opt.step()
        reads.clear()
        trainer.step()
        assert reads == ["tolist"]


# ----- non-finite losses -------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_loss_is_skipped_by_the_switch_rule_and_noted(bad):
    """One bad batch must not pin lam (NaN left it at 0, inf at 1) for the rest of the run."""
    x, y = data()
    runs = {}
    for poison in (False, True):
        model = small_model()
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        trainer = RankAdaptiveTrainer(model, opt, early_steps=3, prune_every=None)
        for step in range(12):
            task = F.cross_entropy(model(x), y)
            if poison and step == 6:
                task = task * bad
            loss = trainer.loss(task)
            opt.zero_grad()
            loss.backward()
            if torch.isfinite(loss):  # an overflowed step updates nothing, as GradScaler does
                opt.step()
            trainer.step()
        runs[poison] = trainer
    clean, poisoned = runs[False], runs[True]
    assert poisoned.history.column("skipped") == [False] * 6 + [True] + [False] * 5
    assert clean.history.column("skipped") == [False] * 12
    assert poisoned.plateau.ema == pytest.approx(clean.plateau.ema, rel=0.05)
    assert poisoned.plateau.count == 11 and clean.plateau.count == 12
    lams = poisoned.history.column("lam")
    assert lams[6] == lams[5]  # the bad step keeps the previous choice
    for r in poisoned.history.records[7:]:  # later steps follow the rule again
        want = size_weight(r["task_loss"], poisoned.task_loss_target, r["params"], r["budget"])
        assert r["lam"] == want
    assert set(lams[7:]) == {1.0}  # the loss is at its target: size is what lags
