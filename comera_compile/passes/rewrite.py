"""Rewrite: build the tensorized layers and put them where the dense ones were.

On a GraphModule the call_module targets keep their names, so swapping the submodules and
recompiling is enough; on any other model we set the attribute on each parent, so the model
keeps its own Python forward. New layers keep the dtype and device of the layers they replace.
"""

from __future__ import annotations

import torch
from torch import nn

from comera_compile.nn import LowRankLinear, TensorizedLayer, TTEmbedding, TTLinear, TTMLinear
from comera_compile.passes.candidates import CONV1D, EMBEDDING_BAG, Candidate
from comera_compile.passes.specs import LOWRANK, TT, TTM, LayerSpec

INITS = ("random", "dense")
LINEAR_CLASSES = {TT: TTLinear, TTM: TTMLinear, LOWRANK: LowRankLinear}


def new_layer(
    cand: Candidate,
    fmt: str,
    ranks: int | list[int],
    in_modes=None,
    out_modes=None,
    order: int | None = None,
    device: torch.device | str | None = None,
) -> TensorizedLayer:
    """A randomly initialised layer for ``cand`` (``device="meta"`` to check settings cheaply)."""
    device = cand.weight.device if device is None else device
    dtype = cand.weight.dtype
    if cand.is_embedding:
        module = cand.module
        mode = module.mode if cand.kind == EMBEDDING_BAG else None
        return TTEmbedding(
            cand.in_features, cand.out_features, ranks=ranks, padding_idx=module.padding_idx,
            mode=mode, row_modes=in_modes, col_modes=out_modes, order=order, device=device,
            dtype=dtype,
        )
    cls = LINEAR_CLASSES[fmt]
    return cls(
        cand.in_features, cand.out_features, ranks=ranks, in_modes=in_modes,
        out_modes=out_modes, bias=cand.bias, order=order, device=device, dtype=dtype,
    )


def _as_linear(cand: Candidate) -> nn.Linear:
    """A Linear view of the layer's weights (HF Conv1D stores ``weight`` as ``(in, out)``)."""
    if cand.kind != CONV1D:
        return cand.module
    linear = nn.Linear(cand.in_features, cand.out_features, bias=cand.bias, device="meta")
    linear.weight = nn.Parameter(cand.weight.detach().T, requires_grad=False)
    if cand.bias:
        linear.bias = nn.Parameter(cand.module.bias.detach(), requires_grad=False)
    return linear


def build_layer(cand: Candidate, spec: LayerSpec, init: str = "random") -> TensorizedLayer:
    """The layer ``spec`` describes: random cores, or a TT-SVD of the current weights."""
    ranks = list(spec.ranks)
    if init == "random":
        layer = new_layer(cand, spec.format, ranks, spec.in_modes, spec.out_modes)
        if cand.bias:  # keep the trained (or initialised) bias: it costs nothing to keep
            layer.bias.data.copy_(cand.module.bias.detach())
        return layer
    if init != "dense":
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    internal = ranks[1:-1]
    with torch.no_grad():
        if cand.is_embedding:
            return TTEmbedding.from_dense(
                cand.module, ranks=internal, row_modes=spec.in_modes, col_modes=spec.out_modes
            )
        cls = LINEAR_CLASSES[spec.format]
        return cls.from_dense(
            _as_linear(cand), ranks=internal, in_modes=spec.in_modes, out_modes=spec.out_modes
        )


def _skip_fused_path(module, args):
    """A no-op pre-hook. PyTorch's fused TransformerEncoderLayer kernel reads
    ``linear1.weight`` directly and is skipped whenever a hook is attached."""
    return None


def _fix_fused_transformers(model: nn.Module) -> None:
    """Keep nn.TransformerEncoder(Layer) off their fused kernels once a Linear is tensorized."""
    for module in model.modules():
        if isinstance(module, nn.TransformerEncoderLayer):
            for child in (module.linear1, module.linear2):
                if isinstance(child, TensorizedLayer) and not child._forward_pre_hooks:
                    child.register_forward_pre_hook(_skip_fused_path)
        if isinstance(module, nn.TransformerEncoder):
            layer = module.layers[0]
            if any(isinstance(m, TensorizedLayer) for m in layer.modules()):
                module.use_nested_tensor = False


def set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name), attr, new)


def rewrite(
    model: nn.Module, chosen: dict[str, tuple[Candidate, LayerSpec]], init: str = "random"
) -> nn.Module:
    """Swap every chosen layer (under each of its names) in place and return ``model``."""
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    for name, (cand, spec) in chosen.items():
        layer = build_layer(cand, spec, init)
        layer.train(cand.module.training)
        for alias in (name, *cand.aliases):
            set_module(model, alias, layer)
    _fix_fused_transformers(model)
    if isinstance(model, torch.fx.GraphModule):
        model.recompile()
    return model
