"""Optimizer parameter groups: structure-aware learning rates from the dense model's one,
and the groups saved and restored by parameter name across prunes."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from comera_compile.formats import lr_multipliers
from comera_compile.nn import tensorized_layers

GATE_RATIO = 10.0
"""Gates over the dense rate: a gate must cross from 1 to its threshold within a stage."""


def _rate_key(value: float) -> float:
    return float(f"{value:.3g}")  # cores whose rates agree to 3 digits share a group


def param_groups(model: nn.Module, lr: float | None = None, *, lr_cores: float | None = None,
                 lr_gates: float | None = None, lr_rest: float | None = None,
                 weight_decay: float = 0.0) -> list[dict[str, Any]]:
    """Parameter groups for ``torch.optim.AdamW`` (or any optimizer taking groups).

    ``lr``: the rate you would give the dense model. Each core then gets its fan-in's
    share of it (one group per distinct rate, named ``cores``), gates ``10 * lr``, the rest
    ``lr``. ``lr_cores`` / ``lr_gates`` / ``lr_rest`` override one kind with a fixed rate.
    Without ``lr`` the reference code's rates apply (``1e-4`` / ``1e-3`` / ``5e-5``).
    ``weight_decay`` applies to cores and rest; gates never decay (the rank penalty moves
    them). Empty groups are left out; every group carries a ``name``. Rates are fixed when
    the groups are made: pruning later changes fan-ins but not the rates.
    """
    if lr is not None and not lr > 0:
        raise ValueError(f"lr must be positive, got {lr!r}")
    structured = lr is not None and lr_cores is None
    if lr is None:
        lr_cores = 1e-4 if lr_cores is None else lr_cores
        lr_gates = 1e-3 if lr_gates is None else lr_gates
        lr_rest = 5e-5 if lr_rest is None else lr_rest
    else:
        lr_gates = GATE_RATIO * lr if lr_gates is None else lr_gates
        lr_rest = lr if lr_rest is None else lr_rest
    core_rates: dict[float, list[nn.Parameter]] = {}
    gates, seen = [], set()
    for layer in tensorized_layers(model).values():
        rates = [lr_cores] * len(layer.cores)
        if structured and hasattr(layer, "core_fan_ins"):
            rates = [lr * m for m in lr_multipliers(layer.core_fan_ins(), layer.dense_fan_in)]
        elif structured:  # a layer kind without fan-ins (a tied head's shared cores): lr
            rates = [lr] * len(layer.cores)
        for p, rate in zip(layer.cores, rates):
            if id(p) not in seen and p.requires_grad:
                core_rates.setdefault(_rate_key(rate), []).append(p)
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
    groups = [{"name": "cores", "params": params, "lr": rate, "weight_decay": weight_decay}
              for rate, params in sorted(core_rates.items())]
    groups += [{"name": "gates", "params": gates, "lr": lr_gates, "weight_decay": 0.0},
               {"name": "rest", "params": rest, "lr": lr_rest, "weight_decay": weight_decay}]
    return [g for g in groups if g["params"]]


def _plain(value: Any) -> bool:
    """Whether a group setting survives JSON as it is (a tensor rate does not)."""
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def group_layout(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 plain: bool = True) -> list[dict[str, Any]] | None:
    """The optimizer's groups with parameter names for parameters, or None where a parameter
    is not the model's; ``plain`` keeps only the settings JSON holds as they are."""
    names = {p: n for n, p in model.named_parameters()}
    if optimizer is None or any(p not in names for g in optimizer.param_groups
                                for p in g["params"]):
        return None
    return [{**{k: v for k, v in g.items() if k != "params" and (_plain(v) or not plain)},
             "params": [names[p] for p in g["params"]]} for g in optimizer.param_groups]


def regroup(model: nn.Module, optimizer: torch.optim.Optimizer, saved: list) -> None:
    """Group ``optimizer``'s parameters by name as they were saved: ``param_groups`` rates
    each core by its fan-in, which pruning changes, so a fresh optimizer on a pruned model
    can group differently, and its ``load_state_dict`` would refuse the saved state or pair
    it with other parameters."""
    mine = group_layout(model, optimizer)
    if not saved or mine is None or [g["params"] for g in mine] == [g["params"] for g in saved]:
        return
    ours = sorted(n for g in mine for n in g["params"])
    theirs = sorted(n for g in saved for n in g["params"])
    if ours != theirs:
        raise ValueError(
            "the saved optimizer held other parameters than this optimizer "
            f"({len(theirs)} saved, {len(ours)} here); build the optimizer over the same "
            "parameters (the same requires_grad settings) as the run that saved"
        )
    params = dict(model.named_parameters())
    optimizer.param_groups.clear()
    for group in saved:
        optimizer.add_param_group({**group, "params": [params[n] for n in group["params"]]})
