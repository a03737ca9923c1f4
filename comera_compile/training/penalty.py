"""The terms CoMERA adds to the task loss, and how big a model is.

- ``rank_penalty``: the early-stage l1 on the rank gates, as the reference code has it: the
  mean magnitude of the *active* gate entries (``|g| > threshold``) over all tensorized
  layers, times a small weight. Dead entries get no gradient (the forward already ignores
  them). An optional l2 on the cores stops the cores from growing to undo the shrinking
  gates.
- ``soft_size``: the late stage's size term ``R``. It is the core parameter count with each
  rank replaced by a "soft rank", the sum of ``|g|`` over the bond's active entries. With
  all gates at 1 it equals the true count; it is differentiable in the gates and weights
  each bond by the parameters it costs, so the late stage cuts expensive bonds first.
  The trainer divides it by its value at late-stage start, so ``R`` starts at 1.
- ``model_size``: what the model weighs now: core parameters at the effective ranks plus
  the live gate entries of every tensorized layer, plus every other parameter.
"""

from __future__ import annotations

from torch import Tensor, nn

from comera_compile.nn import tensorized_layers
from comera_compile.training.bank import GateBank


def rank_penalty(model: nn.Module, weight: float = 0.01, l2_weight: float = 0.0) -> Tensor:
    """``weight * mean(|g|, active g) + l2_weight * sum(core ** 2)`` over tensorized layers."""
    bank = GateBank(model)
    penalty = weight * bank.penalty()
    return penalty + l2_weight * bank.core_l2() if l2_weight else penalty


def core_l2(model: nn.Module) -> Tensor:
    """Sum of squared core entries over all tensorized layers."""
    return GateBank(model).core_l2()


def soft_size(model: nn.Module) -> Tensor:
    """Core parameter count at soft ranks, summed over tensorized layers (differentiable)."""
    return GateBank(model).soft_size()


def effective_ranks(model: nn.Module) -> dict[str, list[int]]:
    """Effective rank list of every tensorized layer, read with one device-to-host copy."""
    bank = GateBank(model)
    counts = bank.alive_counts().tolist() if len(bank) else []
    return bank.ranks(counts)


def model_size(
    model: nn.Module, in_bytes: bool = False, ranks: dict[str, list[int]] | None = None
) -> int:
    """Parameters (or bytes) the model needs once dead rank channels are dropped.

    ``ranks`` (from ``effective_ranks``) saves reading the gates again.
    """
    ranks = effective_ranks(model) if ranks is None else ranks
    seen: set[int] = set()
    size = 0
    for name, layer in tensorized_layers(model).items():
        params = layer.num_core_parameters(ranks[name]) + sum(ranks[name][1:-1])
        size += params * (layer.cores[0].element_size() if in_bytes else 1)
        seen.update(id(p) for p in (*layer.cores, *layer.gates))
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            size += p.numel() * (p.element_size() if in_bytes else 1)
    return size


def tensorized_compression(model: nn.Module, ranks: dict[str, list[int]] | None = None) -> float:
    """Dense weight parameters over core parameters at the effective ranks, over all
    tensorized layers together (biases and gates excluded, as ``compression_ratio``)."""
    ranks = effective_ranks(model) if ranks is None else ranks
    layers = tensorized_layers(model).items()
    dense = sum(layer.dense_parameters for _, layer in layers)
    cores = sum(layer.num_core_parameters(ranks[name]) for name, layer in layers)
    return dense / cores if cores else 1.0
