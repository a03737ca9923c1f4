"""Optimizer parameter groups with the reference's learning rates.

Cores, gates and everything else learn at different speeds in CoMERA: gates must move
fast enough to reach the threshold within a stage, cores are many small factors whose
product amplifies every update, and the rest (biases, norms, dense layers) is ordinary.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from comera_compile.nn import tensorized_layers


def param_groups(
    model: nn.Module,
    lr_cores: float = 1e-4,
    lr_gates: float = 1e-3,
    lr_rest: float = 5e-5,
    weight_decay: float = 0.0,
) -> list[dict[str, Any]]:
    """``[cores, gates, rest]`` groups for ``torch.optim.AdamW``.

    ``weight_decay`` applies to cores and rest; gates never decay (the rank penalty is
    what moves them). Empty groups are left out. Each group carries a ``name``.
    """
    cores, gates, seen = [], [], set()
    for layer in tensorized_layers(model).values():
        for p in layer.cores:
            if id(p) not in seen and p.requires_grad:
                cores.append(p)
                seen.add(id(p))
        for p in layer.gates:
            if id(p) not in seen and p.requires_grad:
                gates.append(p)
                seen.add(id(p))
    rest = []
    for p in model.parameters():
        if id(p) not in seen and p.requires_grad:
            rest.append(p)
            seen.add(id(p))
    groups = [
        {"name": "cores", "params": cores, "lr": lr_cores, "weight_decay": weight_decay},
        {"name": "gates", "params": gates, "lr": lr_gates, "weight_decay": 0.0},
        {"name": "rest", "params": rest, "lr": lr_rest, "weight_decay": weight_decay},
    ]
    return [g for g in groups if g["params"]]
