"""How big a model is: sizes at the effective ranks (plain integers, not loss terms)."""

from __future__ import annotations

from torch import nn

from comera_compile.nn import tensorized_layers
from comera_compile.training.bank import GateBank


def effective_ranks_by_layer(model: nn.Module) -> dict[str, list[int]]:
    """Every tensorized layer's ``effective_ranks()``, by name, read with one device-to-host
    copy (instead of one per gate)."""
    bank = GateBank(model)
    counts = bank.alive_counts().tolist() if len(bank) else []
    return bank.ranks(counts)


def model_size(model: nn.Module, in_bytes: bool = False,
               ranks: dict[str, list[int]] | None = None) -> int:
    """Parameters (or bytes) the model needs once dead rank channels are dropped."""
    ranks = effective_ranks_by_layer(model) if ranks is None else ranks
    seen: set[int] = set()
    size = 0
    for name, layer in tensorized_layers(model).items():
        at = ranks.get(name, layer.ranks)  # a layer without gates keeps its ranks
        params = layer.num_core_parameters(at) + sum(at[1:-1])
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
    ranks = effective_ranks_by_layer(model) if ranks is None else ranks
    layers = tensorized_layers(model).items()
    dense = sum(layer.dense_parameters for _, layer in layers)
    cores = sum(layer.num_core_parameters(ranks.get(name, layer.ranks)) for name, layer in layers)
    return dense / cores if cores else 1.0
