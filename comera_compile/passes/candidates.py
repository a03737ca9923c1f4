"""Candidates: the Linear, Embedding and EmbeddingBag layers a model holds, and for each one
whether it can be swapped at all (tied weights, features our layers lack, weights that a
parent reads directly instead of calling the layer)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from comera_compile.nn import TensorizedLayer
from comera_compile.nn.row_cache import RowCache

LINEAR, CONV1D, EMBEDDING, EMBEDDING_BAG = "linear", "conv1d", "embedding", "embedding_bag"


def is_hf_conv1d(module: nn.Module) -> bool:
    """Hugging Face ``Conv1D`` (GPT-2): a Linear whose weight is stored ``(in, out)``."""
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__ == "Conv1D"
        and hasattr(module, "nf")
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 2
    )


def layer_kind(module: nn.Module) -> str | None:
    if isinstance(module, (TensorizedLayer, RowCache)):  # a TT table's cache is part of it
        return None
    if isinstance(module, nn.Linear):
        return LINEAR
    if isinstance(module, nn.EmbeddingBag):
        return EMBEDDING_BAG
    if isinstance(module, nn.Embedding):
        return EMBEDDING
    if is_hf_conv1d(module):
        return CONV1D
    return None


@dataclass
class Candidate:
    """One layer that could become a tensorized layer."""

    name: str
    module: nn.Module
    kind: str
    in_features: int  # num_embeddings for embeddings
    out_features: int  # embedding_dim for embeddings
    aliases: list[str] = field(default_factory=list)  # other names of the same module
    skip: str | None = None  # why it must stay dense, whatever the user asks
    tied_heads: list[str] = field(default_factory=list)  # Linear layers sharing its weight

    @property
    def is_embedding(self) -> bool:
        return self.kind in (EMBEDDING, EMBEDDING_BAG)

    @property
    def bias(self) -> bool:
        return getattr(self.module, "bias", None) is not None

    @property
    def weight(self) -> torch.Tensor:
        return self.module.weight

    @property
    def dense_params(self) -> int:
        return sum(p.numel() for p in self.module.parameters())

    @property
    def dense_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.module.parameters())

    def describe(self) -> str:
        """``"Linear(768, 3072)"``, as the summary prints the original layer."""
        return f"{type(self.module).__name__}({self.in_features}, {self.out_features})"


def _features(module: nn.Module, kind: str) -> tuple[int, int]:
    if kind == LINEAR:
        return module.in_features, module.out_features
    if kind == CONV1D:
        return module.weight.shape[0], module.weight.shape[1]
    return module.num_embeddings, module.embedding_dim


def _unsupported(module: nn.Module, kind: str) -> str | None:
    """Embedding options TTEmbedding does not implement: swapping would change the model."""
    if kind not in (EMBEDDING, EMBEDDING_BAG):
        return None
    if module.max_norm is not None:
        return "max_norm is not supported by TTEmbedding"
    if module.scale_grad_by_freq:
        return "scale_grad_by_freq is not supported by TTEmbedding"
    return None


def _same_table(module: nn.Module, other: nn.Module) -> bool:
    """Another ``nn.Embedding`` holding this embedding's very weight (T5's shared table)."""
    return (type(other) is nn.Embedding and other.weight is module.weight
            and other.padding_idx == module.padding_idx)


def _tied_group(module: nn.Module, kind: str, tied: list[str], by_name: dict):
    """``(embeddings, heads)`` sharing this embedding's weight, or None when the tie is of
    another sort: the other embeddings are swapped with it, the Linear heads read its cores."""
    if kind != EMBEDDING or not tied:
        return None
    embeddings = [t for t in tied if _same_table(module, by_name[t])]
    heads = [t for t in tied if isinstance(by_name[t], nn.Linear)
             and by_name[t].weight is module.weight]
    return (embeddings, heads) if len(embeddings) + len(heads) == len(tied) else None


def _tied_embedding(module: nn.Module, tied: list[str], by_name: dict) -> str | None:
    """The embedding whose weight this Linear shares, if any."""
    return next((t for t in tied if type(by_name[t]) is nn.Embedding
                 and isinstance(module, nn.Linear) and by_name[t].weight is module.weight),
                None)


def find_candidates(model: nn.Module, weight_reads: set[str] = frozenset()) -> list[Candidate]:
    """Every Linear-like and embedding layer, each module once, in definition order.
    ``weight_reads``: modules whose weight the captured forward reads directly."""
    names: dict[int, list[str]] = {}
    modules: dict[int, nn.Module] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        names.setdefault(id(module), []).append(name)
        modules[id(module)] = module
    owners: dict[int, set[str]] = {}  # parameter identity -> names of the modules holding it
    for key, module in modules.items():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), set()).add(names[key][0])
    read_directly = {  # MultiheadAttention uses out_proj.weight without calling out_proj
        names[id(child)][0]
        for module in modules.values()
        if isinstance(module, nn.MultiheadAttention)
        for child in module.children()
    }
    by_name = {names[key][0]: module for key, module in modules.items()}
    order = {name: i for i, name in enumerate(by_name)}
    found = []
    for key, module in modules.items():
        kind = layer_kind(module)
        if kind is None:
            continue
        name, *aliases = names[key]
        cand = Candidate(name, module, kind, *_features(module, kind), aliases=aliases)
        tied = sorted(other
                      for p in module.parameters(recurse=False)
                      for other in owners[id(p)]
                      if other != name)
        group = _tied_group(module, kind, tied, by_name)
        embedding = _tied_embedding(module, tied, by_name)
        if weight_reads.intersection((name, *aliases)):
            cand.skip = (f"the forward reads '{name}.weight' directly (not only through the "
                         "layer's call), and a tensorized layer has no dense weight to read")
        elif group is not None and any(order[e] < order[name] for e in group[0]):
            first = min(group[0], key=order.__getitem__)
            cand.skip = f"the same table as '{first}': swapped together with it"
        elif group is not None:
            for other in group[0]:
                cand.aliases += names[id(by_name[other])]
            cand.tied_heads = group[1]
            cand.skip = _unsupported(module, kind)
        elif embedding is not None:
            cand.skip = (
                f"weight tied with the embedding '{embedding}': if that is tensorized, this "
                "head computes its logits from the same cores"
            )
        elif tied:
            cand.skip = (
                f"weight tied with {', '.join(repr(t) for t in tied)}; both kept dense so the "
                "tie is not split"
            )
        elif name in read_directly:
            cand.skip = "its parent reads the weight directly instead of calling the layer"
        else:
            cand.skip = _unsupported(module, kind)
        found.append(cand)
    return found
