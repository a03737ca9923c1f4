"""``RankAdaptiveTrainer.target_reached`` means what it says: the model's size is at or under
the size target, in the late stage; checked against the size itself at every step."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import comera_compile as cc
from comera_compile.nn import TensorizedLayer
from comera_compile.training import RankAdaptiveTrainer
from comera_compile.training.trainer import TARGET_TOLERANCE

X = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
Y = X[:, :4].argmax(1)


def live_size(model: nn.Module) -> int:
    """Parameters once dead rank channels are dropped, counted here: each core at its
    layer's effective ranks, the live gate entries, every other parameter whole."""
    size, inside = 0, set()
    for layer in model.modules():
        if isinstance(layer, TensorizedLayer):
            ranks = layer.effective_ranks()
            for k, core in enumerate(layer.cores):
                size += ranks[k] * math.prod(core.shape[1:-1]) * ranks[k + 1]
            size += sum(ranks[1:-1])
            inside.update(id(p) for p in (*layer.cores, *layer.gates))
    return size + sum(p.numel() for p in model.parameters() if id(p) not in inside)


def test_target_reached_is_the_size_near_the_target():
    """``target_reached`` means the counted size is within the tolerance of the target in the
    late stage: never before it, always when that close, and not from the late stage's start
    (it starts above the target)."""
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(),
                          nn.Linear(256, 4))
    model = cc.optimize(dense, cc.CompressionConfig(budget=0.5, format="tt", compile=False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    trainer = RankAdaptiveTrainer(model, optimizer, target_ratio=0.5, early_steps=6,
                                  prune_every=3, total_steps=30)
    seen = []
    for _ in range(30):
        loss = trainer.loss(F.cross_entropy(model(X), Y))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        trainer.step()
        size = live_size(model)
        assert trainer.size() == size
        late = trainer.stage == "late"
        near = late and abs(size - trainer.size_target) <= TARGET_TOLERANCE * trainer.size_target
        if near or not late:
            assert trainer.target_reached == near, (trainer.steps, size, trainer.size_target)
        seen.append((late, trainer.target_reached))
    assert (True, False) in seen  # the late stage began far above the target: not reached then
    assert seen[-1] == (True, True)  # and the run ends on it
    assert abs(live_size(model) / trainer.size_target - 1) <= TARGET_TOLERANCE
    assert trainer.size_target == 0.5 * trainer.size_start
