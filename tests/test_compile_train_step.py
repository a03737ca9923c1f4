"""The parts of the captured train step that need no GPU: warm-up leaves the optimizer
exactly as it found it (any optimizer), the re-record signature, ``lr`` as a tensor under an
LR scheduler, compiled models unwrapped."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import comera_compile.compile as cc
from comera_compile.compile.train_step import _make_capturable, _Snapshot, unwrap
from comera_compile.nn import TTLinear


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(TTLinear(32, 24, ranks=3), nn.Tanh(), nn.Linear(24, 4))


def loss_fn(m, batch):
    x, y = batch
    return F.cross_entropy(m(x), y)


def data(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 32, generator=g), torch.randint(0, 4, (8,), generator=g)


def one_step(m, optimizer, batch) -> None:
    optimizer.zero_grad(set_to_none=True)
    loss_fn(m, batch).backward()
    optimizer.step()


@pytest.mark.parametrize("name", ["NAdam", "ASGD", "AdamW"])
@pytest.mark.parametrize("started", [False, True])
def test_warmup_restores_the_optimizer_exactly(name, started):
    """After warm-up and restore, a step gives what the same step gives without warm-up
    (NAdam's mu_product starts at 1 and ASGD's eta at lr: zeros would be wrong)."""
    make = getattr(torch.optim, name)
    ref_model = model()
    ref_opt = make(ref_model.parameters(), lr=1e-2)
    test_model = copy.deepcopy(ref_model)
    test_opt = make(test_model.parameters(), lr=1e-2)
    if started:  # optimizer state that exists before warm-up is put back as it was
        for m, o in ((ref_model, ref_opt), (test_model, test_opt)):
            one_step(m, o, data(0))
    params = list(test_model.parameters())
    snapshot = _Snapshot(params, test_opt)
    for seed in range(1, 4):  # warm-up steps
        one_step(test_model, test_opt, data(seed))
    snapshot.restore(params, test_opt)
    for m, o in ((ref_model, ref_opt), (test_model, test_opt)):
        one_step(m, o, data(9))
    for p, q in zip(ref_model.parameters(), test_model.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0)
        for key, value in ref_opt.state[p].items():
            torch.testing.assert_close(torch.as_tensor(test_opt.state[q][key]),
                                       torch.as_tensor(value), rtol=0, atol=0, msg=key)


def test_lr_becomes_a_tensor_that_schedulers_update_in_place():
    m = model()
    optimizer = torch.optim.AdamW(m.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    _make_capturable(optimizer)
    lr = optimizer.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and optimizer.param_groups[0]["capturable"]
    step = cc.TrainStep(m, optimizer, loss_fn, data(0), compile=False)
    for group in optimizer.param_groups:  # CPU cannot run capturable AdamW; the lr can
        group["capturable"] = False
    one_step(m, optimizer, data(0))
    before = step._current_signature(*_flat(data(0)))
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] is lr  # filled, not replaced: a graph reads it
    assert float(lr) == pytest.approx(5e-3)
    assert step._current_signature(*_flat(data(0))) == before  # no re-record needed


def _flat(batch):
    from torch.utils._pytree import tree_flatten

    return tree_flatten(batch)


def test_signature_sees_addresses_dtypes_state_and_hyperparameters():
    m = model()
    optimizer = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.0)
    step = cc.TrainStep(m, optimizer, loss_fn, data(0), compile=False)
    one_step(m, optimizer, data(0))
    sig = lambda batch=None: step._current_signature(*_flat(batch or data(0)))  # noqa: E731
    first = sig()
    assert sig(data(5)) == first  # new values, same layout: replay
    x, y = data(0)
    assert sig((x.double(), y)) != first  # dtype
    assert sig((x[:4], y[:4])) != first  # shape
    optimizer.param_groups[0]["weight_decay"] = 0.1
    assert sig() != first  # baked-in hyperparameter
    optimizer.param_groups[0]["weight_decay"] = 0.0
    assert sig() == first
    optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    assert sig() != first  # same values, new state tensors
    after_load = sig()
    with torch.no_grad():
        m[0].gates[0][0] = 0.0
    m[0].prune_ranks()
    assert sig() != after_load  # new parameter memory (and shapes)


def test_a_compiled_model_is_unwrapped():
    m = model()
    compiled = torch.compile(m, backend="comera")
    assert unwrap(compiled) is m
    optimizer = torch.optim.AdamW(m.parameters(), lr=1e-2)
    step = cc.capture_train_step(compiled, optimizer, loss_fn, data(0), compile=False)
    assert step.model is m
    losses = [float(step(data(0))) for _ in range(5)]
    assert losses[-1] < losses[0]
