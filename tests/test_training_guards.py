"""The plain training loop's edges: an optimizer whose state cannot follow a rank cut is
refused when the trainer is built, and the README's resume route (``cc.save``,
``optimizer.state_dict()``, ``trainer.state_dict()``, restored into a model rebuilt from the
checkpoint) continues the run exactly."""

from __future__ import annotations

import io
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import comera_compile as cc
from comera_compile.training import RankAdaptiveTrainer, param_groups

X = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
Y = X[:, :4].argmax(1)
OPTIONS = {"target_ratio": 0.5, "early_steps": 6, "prune_every": 3, "total_steps": 24}


def dense() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(),
                         nn.Linear(256, 4))


def optimized() -> nn.Module:
    return cc.optimize(dense(), cc.CompressionConfig(budget=0.5, format="tt", compile=False))


def test_lbfgs_is_refused_naming_the_optimizers_that_work():
    model = optimized()
    optimizer = torch.optim.LBFGS(model.parameters())
    with pytest.raises(ValueError, match=r"LBFGS .* flat vectors.*SGD, Adam, AdamW"):
        RankAdaptiveTrainer(model, optimizer, **OPTIONS)


def step(model, optimizer, trainer) -> None:
    loss = trainer.loss(F.cross_entropy(model(X), Y))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    trainer.step()


def test_the_readme_resume_route_equals_the_uninterrupted_run(tmp_path):
    model = optimized()
    optimizer = torch.optim.AdamW(param_groups(model, lr=3e-3))  # rates by fan-in
    trainer = RankAdaptiveTrainer(model, optimizer, **OPTIONS)
    for _ in range(12):
        step(model, optimizer, trainer)
    assert trainer.cuts > 0  # the fan-ins changed: a fresh param_groups groups otherwise
    cc.save(model, tmp_path / "ckpt")
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    trainer_state = json.dumps(trainer.state_dict())
    for _ in range(12):
        step(model, optimizer, trainer)

    resumed = cc.load(tmp_path / "ckpt", model=dense())
    fresh_optimizer = torch.optim.AdamW(param_groups(resumed, lr=3e-3))
    assert len(fresh_optimizer.param_groups) != len(optimizer.param_groups)
    fresh_trainer = RankAdaptiveTrainer(resumed, fresh_optimizer, **OPTIONS)
    fresh_trainer.load_state_dict(json.loads(trainer_state))
    buffer.seek(0)
    fresh_optimizer.load_state_dict(torch.load(buffer))
    for _ in range(12):
        step(resumed, fresh_optimizer, fresh_trainer)
    final, got = model.state_dict(), resumed.state_dict()
    assert list(got) == list(final)
    for key, value in final.items():
        assert torch.equal(got[key], value), key
    assert fresh_trainer.history.records == trainer.history.records
