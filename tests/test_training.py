"""Rank-adaptive training: penalty gradients, the late-stage switch rule, pruning with
optimizer state, checkpoint/resume, history and plots."""

import copy
import csv
import io
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from comera_compile.nn import TTLinear
from comera_compile.training import (
    LATE,
    Plateau,
    RankAdaptiveTrainer,
    effective_ranks_by_layer,
    late_stage_loss,
    model_size,
    param_groups,
    plot_compression,
    plot_ranks,
    prune_model,
    rank_penalty,
    size_weight,
    soft_size,
    tensorized_compression,
)


def tiny_layer():
    """ranks [1, 2, 3, 2, 1]: gates of sizes 2, 3, 2."""
    return TTLinear(6, 4, ranks=3, in_modes=[2, 3], out_modes=[2, 2]).double()


def small_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        TTLinear(16, 12, ranks=4, in_modes=[4, 4], out_modes=[3, 4]),
        nn.Tanh(),
        TTLinear(12, 3, ranks=3, in_modes=[3, 4], out_modes=[1, 3]),
    ).double()


def adamw(model):
    return torch.optim.AdamW(param_groups(model, lr_cores=1e-2, lr_gates=1e-3, lr_rest=1e-2))


def data(seed=1, n=32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g, dtype=torch.float64)
    return x, (x[:, :3].argmax(1))


# ----- penalty -----------------------------------------------------------------------------
@pytest.mark.parametrize("l2", [0.0, 0.1])
def test_penalty_gradient_reaches_only_gates_and_cores(l2):
    layer = tiny_layer()
    head = nn.Linear(4, 2).double()
    model = nn.Sequential(layer, head)
    values = [[0.5, -2.0], [0.005, -0.3, 1.0], [-0.001, 0.02]]  # 0.005, -0.001: inactive
    with torch.no_grad():
        for g, v in zip(layer.gates, values):
            g.copy_(torch.tensor(v, dtype=torch.float64))
    penalty = rank_penalty(model, weight=0.01, l2_weight=l2)
    active = [0.5, 2.0, 0.3, 1.0, 0.02]
    squares = sum(float(c.detach().pow(2).sum()) for c in layer.cores)
    assert penalty.item() == pytest.approx(0.01 * sum(active) / 5 + l2 * squares, rel=1e-12)
    penalty.backward()
    expected = [[0.002, -0.002], [0.0, -0.002, 0.002], [0.0, 0.002]]  # 0.01 * sign / 5
    for g, e in zip(layer.gates, expected):
        torch.testing.assert_close(g.grad, torch.tensor(e, dtype=torch.float64))
    for core in layer.cores:
        if l2:
            torch.testing.assert_close(core.grad, 2 * l2 * core.detach())
        else:
            assert core.grad is None
    assert layer.bias.grad is None and head.weight.grad is None and head.bias.grad is None


def test_soft_size_is_core_count_at_unit_gates_and_weights_bonds_by_cost():
    layer = tiny_layer()
    assert soft_size(layer).item() == layer.num_core_parameters() == 4 + 18 + 12 + 4
    soft_size(layer).backward()
    # d/ds_k of sum_k n_k s_{k-1} s_k: n_k s_{k-1} + n_{k+1} s_{k+1}, per gate entry.
    # n = [2, 3, 2, 2], s = [1, 2, 3, 2, 1]
    expected = [2 * 1 + 3 * 3, 3 * 2 + 2 * 2, 2 * 3 + 2 * 1]
    for g, e in zip(layer.gates, expected):
        assert torch.all(g.grad == e)


def test_model_size_counts_live_channels_and_other_params():
    layer = tiny_layer()
    model = nn.Sequential(layer, nn.Linear(4, 2))
    other = 4 + 2 * 4 + 2  # TT bias, Linear weight and bias
    assert model_size(model) == 38 + 7 + other
    with torch.no_grad():
        layer.gates[1][0] = 0.0  # rank 3 -> 2 on bond 2: cores 1 and 2 lose 6 and 4
    assert model_size(model) == 38 - 10 + 6 + other
    assert effective_ranks_by_layer(model) == {"0": [1, 2, 2, 2, 1]} == {
        "0": layer.effective_ranks()
    }
    assert model_size(model, in_bytes=True) == (28 + 6 + 4) * 8 + 10 * 4  # float32 Linear
    assert tensorized_compression(model) == pytest.approx(24 / 28)


# ----- the late-stage switch rule ----------------------------------------------------------
@pytest.mark.parametrize(
    "loss, loss_target, size, size_target, lam",
    [
        (1.0, 1.0, 100, 20, 1.0),  # loss on target, size 80% off: shrink
        (2.0, 1.0, 100, 20, 1.0),  # loss 50% off, size 80% off: shrink
        (2.0, 1.0, 100, 60, 0.0),  # loss 50% off, size 40% off: fix the loss
        (1.0, 0.5, 100, 90, 0.0),  # loss 50% off, size 10% off: fix the loss
        (1.0, 1.0, 20, 20, 0.0),  # both on target: the task loss wins ties
        (0.8, 1.0, 20, 20, 1.0),  # loss below target, size on target: -0.25 < 0
        (1.0, 0.9, 15, 20, 0.0),  # size already below target: fix the loss
    ],
)
def test_switch_rule_picks_the_objective_further_from_its_target(
    loss, loss_target, size, size_target, lam
):
    assert size_weight(loss, loss_target, size, size_target) == lam


def test_late_stage_loss_is_the_reference_mix():
    L, R = torch.tensor(2.0), torch.tensor(0.5)
    assert late_stage_loss(L, R, 1.0).item() == pytest.approx(0.2 + 0.005 + 0.5)
    assert late_stage_loss(L, R, 0.0).item() == pytest.approx(0.2 + 0.005 + 2.0)


def test_plateau_waits_for_patience_steps_without_improvement():
    p = Plateau(patience=5, beta=0.5)  # judged from the 2nd value on (1 / (1 - beta))
    assert [p.update(1.0) for _ in range(7)] == [False] * 6 + [True]
    assert not p.update(0.2)  # the EMA drops to 0.6: improvement resets the count
    assert p.best == 0.6 and p.since_best == 0
    assert not Plateau(patience=None, beta=0.5).update(1.0)


# ----- pruning with optimizer state --------------------------------------------------------
def _train_step(model, optimizer, x, y):
    loss = F.cross_entropy(model(x), y) + rank_penalty(model)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def _kill_channels(model):
    with torch.no_grad():
        model[0].gates[0][[1]] = 0.0
        model[0].gates[1][[0, 2]] = 0.0
        model[2].gates[1][[2]] = 0.0


def test_pruning_mid_training_matches_masked_training():
    x, y = data()
    pruned = small_model()
    masked = copy.deepcopy(pruned)
    opt_p, opt_m = adamw(pruned), adamw(masked)
    for _ in range(3):
        _train_step(pruned, opt_p, x, y)
        _train_step(masked, opt_m, x, y)
    _kill_channels(pruned)
    _kill_channels(masked)
    before = masked(x)

    results = prune_model(pruned, opt_p)
    assert set(results) == {"0", "2"}
    assert pruned[0].ranks == [1, 3, 2, 4, 1] and pruned[2].ranks == [1, 3, 2, 3, 1]
    torch.testing.assert_close(pruned(x), before, rtol=1e-12, atol=1e-12)
    for group in opt_p.param_groups:
        for p in group["params"]:
            state = opt_p.state[p]
            assert state["exp_avg"].shape == p.shape == state["exp_avg_sq"].shape
            assert state["step"].item() == 3
    assert sum(c.numel() for c in pruned[0].cores) == 4 * 3 + 3 * 4 * 2 + 2 * 3 * 4 + 4 * 4

    for _ in range(2):
        loss_p = _train_step(pruned, opt_p, x, y)
        loss_m = _train_step(masked, opt_m, x, y)
        assert loss_p == pytest.approx(loss_m, rel=1e-10)
    torch.testing.assert_close(pruned(x), masked(x), rtol=1e-5, atol=1e-5)
    assert pruned[0].effective_ranks() == masked[0].effective_ranks()


class FlatMomentum(torch.optim.Optimizer):
    """A user's optimizer whose state is not shaped like its parameter."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["buf"] = torch.zeros(p.numel(), dtype=p.dtype)
                state["buf"].mul_(0.9).add_(p.grad.flatten())
                p.add_(state["buf"].view_as(p), alpha=-group["lr"])


ELEMENTWISE = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-3, amsgrad=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-4, momentum=0.5, centered=True),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-3),
}


@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
def test_pruning_slices_the_state_of_every_elementwise_optimizer(name):
    """Pruned training equals masked training: the state was cut exactly."""
    x, y = data()
    pruned = small_model()
    masked = copy.deepcopy(pruned)
    opt_p, opt_m = ELEMENTWISE[name](pruned.parameters()), ELEMENTWISE[name](masked.parameters())
    for _ in range(3):
        _train_step(pruned, opt_p, x, y)
        _train_step(masked, opt_m, x, y)
    _kill_channels(pruned)
    _kill_channels(masked)
    prune_model(pruned, opt_p)
    for p in pruned.parameters():
        for value in opt_p.state[p].values():
            if torch.is_tensor(value) and value.dim():
                assert value.shape == p.shape
    for _ in range(3):
        assert _train_step(pruned, opt_p, x, y) == pytest.approx(
            _train_step(masked, opt_m, x, y), rel=1e-10
        )


@pytest.mark.parametrize("name", ["adafactor", "flat-momentum", *sorted(ELEMENTWISE)])
def test_rank_adaptive_run_with_every_optimizer_prunes_and_trains_on(name):
    x, y = data()
    model = small_model()
    build = {"adafactor": lambda ps: torch.optim.Adafactor(ps, lr=1e-2),
             "flat-momentum": FlatMomentum, **ELEMENTWISE}[name]
    opt = build(model.parameters())
    trainer = RankAdaptiveTrainer(model, opt, early_steps=4, prune_every=2, target_ratio=0.5,
                                  total_steps=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the flat optimizer's reset is warned about above
        losses = [_trainer_step(model, opt, trainer, x, y) for _ in range(16)]
    assert trainer.target_reached and model[0].ranks != [1, 4, 4, 4, 1]
    assert sum(r["pruned"] for r in trainer.history.records) > 0
    assert all(math.isfinite(v) for v in losses)
    for p in model.parameters():  # every state the optimizer kept fits its parameter
        for value in opt.state[p].values():
            if torch.is_tensor(value) and value.dim() == p.dim():
                assert all(s in (1, n) for s, n in zip(value.shape, p.shape))


def test_pruning_slices_adafactor_factored_state():
    x, y = data()
    model = small_model()
    opt = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    for _ in range(3):
        _train_step(model, opt, x, y)
    _kill_channels(model)
    core = model[0].cores[1]  # (4, 4, 4): loses channel 1 on the left, 0 and 2 on the right
    before = {k: v.clone() for k, v in opt.state[core].items()}
    assert before["row_var"].shape == (4, 4, 1) and before["col_var"].shape == (4, 1, 4)
    prune_model(model, opt)
    assert core.shape == (3, 4, 2)
    state = opt.state[core]
    assert state["row_var"].shape == (3, 4, 1) and state["col_var"].shape == (3, 1, 2)
    torch.testing.assert_close(state["row_var"], before["row_var"][[0, 2, 3]])
    torch.testing.assert_close(state["col_var"], before["col_var"][[0, 2, 3]][..., [1, 3]])
    assert state["step"] == before["step"] == 3
    losses = [_train_step(model, opt, x, y) for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def test_pruning_resets_state_it_cannot_slice_with_a_warning():
    x, y = data()
    model = small_model()
    opt = FlatMomentum(model.parameters())
    for _ in range(3):
        _train_step(model, opt, x, y)
    _kill_channels(model)
    core = model[0].cores[1]
    untouched = model[2].cores[0]  # bond 1 of layer 2 keeps all its channels
    kept = opt.state[untouched]["buf"].clone()
    with pytest.warns(UserWarning, match=r"FlatMomentum state 'buf' \[64\].*was reset"):
        prune_model(model, opt)
    assert core not in opt.state and untouched in opt.state
    torch.testing.assert_close(opt.state[untouched]["buf"], kept)
    _train_step(model, opt, x, y)  # starts the reset state afresh
    assert opt.state[core]["buf"].shape == (core.numel(),) == (24,)


# ----- the trainer -------------------------------------------------------------------------
def _trainer_step(model, optimizer, trainer, x, y):
    loss = trainer.loss(F.cross_entropy(model(x), y))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    trainer.step()
    return loss.item()


def test_checkpoint_after_pruning_resumes_to_the_same_loss():
    x, y = data()
    model = small_model()
    opt = adamw(model)
    trainer = RankAdaptiveTrainer(model, opt, early_steps=3, prune_every=2, target_ratio=0.5)
    _trainer_step(model, opt, trainer, x, y)
    _kill_channels(model)
    for _ in range(3):
        _trainer_step(model, opt, trainer, x, y)
    assert trainer.stage == LATE and model[0].ranks == [1, 3, 2, 4, 1]

    buffer = io.BytesIO()
    torch.save(
        {"model": model.state_dict(), "opt": opt.state_dict(), "trainer": trainer.state_dict()},
        buffer,
    )
    expected = [_trainer_step(model, opt, trainer, x, y) for _ in range(2)]

    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    fresh = small_model(seed=7)
    fresh.load_state_dict(saved["model"])  # resizes the pruned layers
    fresh_opt = adamw(fresh)  # built after loading, so it holds the resized parameters
    fresh_opt.load_state_dict(saved["opt"])
    resumed = RankAdaptiveTrainer(fresh, fresh_opt, early_steps=3, prune_every=2, target_ratio=0.5)
    resumed.load_state_dict(saved["trainer"])
    got = [_trainer_step(fresh, fresh_opt, resumed, x, y) for _ in range(2)]
    assert got == pytest.approx(expected, rel=1e-12)
    assert len(resumed.history) == len(trainer.history) == 6


def test_resume_through_comera_save_equals_the_uninterrupted_run(tmp_path):
    """Weights through ``cc.save`` / ``cc.load`` (a fresh model takes the pruned ranks), the
    trainer's state through JSON: the resumed run is the run."""
    import json

    import comera_compile as cc

    x, y = data()
    model = small_model()
    opt = adamw(model)
    options = {"early_steps": 4, "prune_every": 2, "target_ratio": 0.4, "total_steps": 16}
    trainer = RankAdaptiveTrainer(model, opt, **options)
    for _ in range(8):
        _trainer_step(model, opt, trainer, x, y)
    assert trainer.stage == LATE and model[0].ranks != [1, 4, 4, 4, 1]
    cc.save(model, tmp_path / "ckpt")
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    (tmp_path / "trainer.json").write_text(json.dumps(trainer.state_dict()))
    expected = [_trainer_step(model, opt, trainer, x, y) for _ in range(8)]

    fresh = cc.load(tmp_path / "ckpt", model=small_model(seed=7))
    fresh_opt = adamw(fresh)
    fresh_opt.load_state_dict(torch.load(tmp_path / "opt.pt"))
    resumed = RankAdaptiveTrainer(fresh, fresh_opt, **options)
    resumed.load_state_dict(json.loads((tmp_path / "trainer.json").read_text()))
    got = [_trainer_step(fresh, fresh_opt, resumed, x, y) for _ in range(8)]
    assert got == pytest.approx(expected, rel=1e-12)
    assert fresh[0].ranks == model[0].ranks and fresh[2].ranks == model[2].ranks
    assert resumed.size() == trainer.size()
    assert resumed.target_gap == trainer.target_gap and abs(trainer.target_gap) <= 0.05
    assert resumed.history.records == trainer.history.records
    assert resumed.cuts == trainer.cuts > 0


def test_trainer_reaches_target_and_loss_goes_down(tmp_path):
    x, y = data(n=64)
    model = small_model()
    opt = torch.optim.AdamW(param_groups(model, lr_cores=1e-2, lr_gates=3e-2, lr_rest=1e-2))
    trainer = RankAdaptiveTrainer(model, opt, early_steps=40, prune_every=10, target_ratio=0.5)
    start = trainer.size()
    for _ in range(140):
        _trainer_step(model, opt, trainer, x, y)
    h = trainer.history
    task_losses = h.column("task_loss")
    assert sum(task_losses[35:40]) / 5 < 0.5 * task_losses[0]  # the early stage learns
    assert trainer.target_reached
    assert trainer.size_target == 0.5 * start  # the size the trainer started with, halved
    assert abs(trainer.size() - trainer.size_target) <= 0.05 * trainer.size_target
    assert h.column("params")[-1] < h.column("params")[0]
    assert sum(task_losses[-5:]) / 5 < 0.6 * task_losses[0]  # and the late stage keeps most of it
    # the cores really shrank: stored ranks equal effective ranks after the last prune
    assert model[0].ranks == model[0].effective_ranks()

    path = h.to_csv(tmp_path / "h.csv")
    rows = list(csv.DictReader(path.open()))
    assert len(rows) == 140 and rows[0]["stage"] == "early" and rows[-1]["stage"] == "late"
    assert int(rows[-1]["rank:0:2"]) == model[0].ranks[2]
    for plot in (plot_ranks(h, tmp_path / "r.png"), plot_compression(h, tmp_path / "c.png")):
        assert plot.stat().st_size > 5000


def test_plateau_starts_the_late_stage():
    x, y = data()
    model = small_model()
    opt = adamw(model)
    trainer = RankAdaptiveTrainer(model, opt, early_steps=None, plateau_patience=5)
    with torch.no_grad():
        for p in model.parameters():
            p.requires_grad_(False)  # a frozen model: the loss is flat from the start
    steps = 0
    while trainer.stage != LATE and steps < 200:
        trainer.loss(F.cross_entropy(model(x), y))
        trainer.step()
        steps += 1
    assert trainer.stage == LATE
    assert 50 + 5 <= steps <= 50 + 6  # 1 / (1 - beta) warm-up steps, then the patience
    assert trainer.task_loss_target == pytest.approx(F.cross_entropy(model(x), y).item())


def test_param_groups_split_cores_gates_rest():
    model = small_model()
    groups = {g["name"]: g for g in param_groups(model, weight_decay=0.1)}
    assert len(groups["cores"]["params"]) == 8 and len(groups["gates"]["params"]) == 6
    assert len(groups["rest"]["params"]) == 2  # the biases
    assert [groups[k]["lr"] for k in ("cores", "gates", "rest")] == [1e-4, 1e-3, 5e-5]
    assert groups["gates"]["weight_decay"] == 0.0 and groups["cores"]["weight_decay"] == 0.1


def test_bad_targets_name_the_fix():
    model = small_model()
    with pytest.raises(ValueError, match="not both"):
        RankAdaptiveTrainer(model, adamw(model), target_params=10, target_bytes=10)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        RankAdaptiveTrainer(model, adamw(model), target_ratio=2.0)


def test_pruning_while_last_steps_graph_is_alive():
    """``loss = ...`` keeps the previous graph until the new one is built; pruning between
    them must not leave autograd expecting the old shapes."""
    x, y = data()
    model = small_model()
    opt = adamw(model)
    loss = F.cross_entropy(model(x), y) + rank_penalty(model)
    loss.backward()
    _kill_channels(model)
    prune_model(model, opt)
    loss = F.cross_entropy(model(x), y) + rank_penalty(model)
    loss.backward()
    assert model[0].gates[1].grad.shape == (2,)


def test_min_rank_keeps_every_bond_alive():
    from comera_compile import TTLinear
    from comera_compile.training import keep_min_rank

    layer = TTLinear(64, 48, ranks=6)
    with torch.no_grad():
        layer.gates[0].fill_(0.001)  # the whole bond below the threshold
        layer.gates[1][:] = torch.tensor([0.5, -0.004, 0.002, 0.003, 0.001, 0.0])
    lifted = keep_min_rank(layer, min_rank=2)
    ranks = layer.effective_ranks()
    assert lifted == 3 and ranks[1] == 2 and ranks[2] == 2
    assert layer.gates[1][1].item() == pytest.approx(-2 * layer.threshold)  # sign kept
    assert keep_min_rank(layer, min_rank=2) == 0
