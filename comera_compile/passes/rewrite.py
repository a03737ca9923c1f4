"""Rewrite: build the tensorized layers and put them where the dense ones were."""

from __future__ import annotations

import math

import torch
from torch import nn

from comera_compile.formats import (
    BTT,
    COLA,
    LOWRANK,
    MONARCH,
    TT,
    TT_EMBEDDING,
    TTM,
    chain_norm,
    is_lowrank_table,
)
from comera_compile.nn import (
    DEFAULT_THRESHOLD,
    BTTLinear,
    CoLALinear,
    LowRankLinear,
    MonarchLinear,
    SplitMultiheadAttention,
    TensorizedLayer,
    TiedEmbeddingHead,
    TTEmbedding,
    TTLinear,
    TTMLinear,
)
from comera_compile.nn.attention import SPLIT_ATTENTION
from comera_compile.nn.tied_head import TIED_HEAD
from comera_compile.nn.tt_embedding import dense_options
from comera_compile.passes.candidates import CONV1D, Candidate, is_hf_conv1d
from comera_compile.passes.specs import LayerSpec

INITS = ("random", "dense")
LINEAR_CLASSES = {TT: TTLinear, TTM: TTMLinear, LOWRANK: LowRankLinear, COLA: CoLALinear,
                  BTT: BTTLinear, MONARCH: MonarchLinear}


def check_init(init: str) -> None:
    """``init`` must name a way to start the cores: ``"random"`` or ``"dense"`` (TT-SVD)."""
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")


def new_layer(cand: Candidate, fmt: str, ranks: int | list[int], in_modes=None, out_modes=None,
              order: int | None = None,
              device: torch.device | str | None = None) -> TensorizedLayer:
    """A randomly initialised layer for ``cand`` (``device="meta"`` to check settings cheaply)."""
    device = cand.weight.device if device is None else device
    dtype = cand.weight.dtype
    if cand.is_embedding:
        return TTEmbedding(cand.in_features, cand.out_features, ranks=ranks, row_modes=in_modes,
                           col_modes=out_modes, order=order, device=device, dtype=dtype,
                           **dense_options(cand.module))
    cls = LINEAR_CLASSES[fmt]
    return cls(cand.in_features, cand.out_features, ranks=ranks, in_modes=in_modes,
               out_modes=out_modes, bias=cand.bias, order=order, device=device, dtype=dtype)


def match_weight_scale(layer: TensorizedLayer, weight: torch.Tensor) -> None:
    """Scale random cores so the layer's weight has the RMS of the weight it replaces (a model
    that initialises its own way, as Hugging Face's std 0.02, would otherwise start far off).
    The factor is shared equally by the cores, keeping their fan-in balance
    (``formats.scaling``)."""
    with torch.no_grad():
        target = float(weight.detach().float().square().mean().sqrt())
        norm = getattr(layer, "frobenius_norm", None)  # block layers: not a plain chain
        current = (norm() if norm else chain_norm(layer.chain_cores())) / math.sqrt(
            weight.numel())
        if target > 0 and current > 0:
            factor = (target / current) ** (1.0 / len(layer.cores))
            for core in layer.cores:
                core.mul_(factor)


def _as_linear(cand: Candidate) -> nn.Linear:
    """A Linear view of the layer's weights (HF Conv1D stores ``weight`` as ``(in, out)``)."""
    if cand.kind != CONV1D:
        return cand.module
    linear = nn.Linear(cand.in_features, cand.out_features, bias=cand.bias, device="meta")
    linear.weight = nn.Parameter(cand.weight.detach().T, requires_grad=False)
    if cand.bias:
        linear.bias = nn.Parameter(cand.module.bias.detach(), requires_grad=False)
    return linear


def build_layer(cand: Candidate, spec: LayerSpec, init: str = "random",
                device: torch.device | str = "cpu",
                gram: torch.Tensor | None = None) -> TensorizedLayer:
    """The layer ``spec`` describes: random cores, or a TT-SVD of the current weights."""
    ranks = list(spec.ranks)
    meta = cand.weight.is_meta
    if meta and init != "random":
        raise ValueError(
            f"'{cand.name}' is on the meta device, so there is no weight to decompose with "
            "init='dense'; use init='random' (train from scratch) or build the model for real"
        )
    if init == "random":
        layer = new_layer(cand, spec.format, ranks, spec.in_modes, spec.out_modes,
                          device=device if meta else None)
        if not meta:
            match_weight_scale(layer, cand.weight)
        if cand.bias and not meta:  # keep the trained (or initialised) bias: it costs nothing
            layer.bias.data.copy_(cand.module.bias.detach())
        return layer
    check_init(init)
    internal = ranks[1:-1]
    with torch.no_grad():
        if cand.is_embedding:
            weighed = gram is not None and is_lowrank_table(spec.in_modes, spec.out_modes)
            return TTEmbedding.from_dense(
                cand.module, ranks=internal, row_modes=spec.in_modes, col_modes=spec.out_modes,
                row_frequencies=gram if weighed else None,
            )
        cls = LINEAR_CLASSES[spec.format]
        return cls.from_dense(
            _as_linear(cand), ranks=internal, in_modes=spec.in_modes, out_modes=spec.out_modes,
            gram=gram,
        )


def _fix_fused_transformers(model: nn.Module) -> None:
    """Keep nn.TransformerEncoder off its nested-tensor path once a layer inside is
    tensorized (that path reads the first layer's dense weights directly). The encoder layer's
    fused eval kernel needs no switch: its guard refuses our meta ``weight`` placeholders
    (``test_transformer_encoder_eval_fast_path_is_skipped``)."""
    for module in model.modules():
        if isinstance(module, nn.TransformerEncoder):
            layer = module.layers[0]
            if any(isinstance(m, (TensorizedLayer, SplitMultiheadAttention))
                   for m in layer.modules()):
                module.use_nested_tensor = False


def set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name), attr, new)


def tie_head(model: nn.Module, head_name: str, embedding: TTEmbedding, tied_to: str) -> None:
    """Replace the Linear at ``head_name`` (tied to the embedding's weight) with a head on the
    tensorized embedding's cores; its bias (shared or not) is kept as it is."""
    dense = model.get_submodule(head_name)
    head = TiedEmbeddingHead(embedding, tied_to, dense.bias)
    head.train(dense.training)
    for alias in names_of(model, dense):
        set_module(model, alias, head)


def declare_shared_to_hf(model: nn.Module) -> None:
    """Tell a Hugging Face model which of its parameter names are one tensor (a tensorized
    table under several names, as T5's shared embedding), so ``save_pretrained`` writes it
    once instead of refusing the shared tensors."""
    if not hasattr(type(model), "_tied_weights_keys"):
        return
    tied = dict(getattr(model, "_tied_weights_keys", None) or {})
    seen: dict[int, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if not isinstance(module, TensorizedLayer):
            continue
        if id(module) not in seen:
            seen[id(module)] = name
            continue
        for key, _ in module.named_parameters():
            tied[f"{name}.{key}"] = f"{seen[id(module)]}.{key}"
    if len(tied) > len(getattr(model, "_tied_weights_keys", None) or {}):
        model._tied_weights_keys = tied


def names_of(model: nn.Module, module: nn.Module) -> list[str]:
    """Every qualified name under which ``module`` sits in ``model``."""
    return [n for n, m in model.named_modules(remove_duplicate=False) if m is module]


def _dense_features(module: nn.Module) -> tuple[str, int, int] | None:
    """``(kind, in, out)`` of a dense layer a saved tensorized layer may replace."""
    if isinstance(module, nn.Linear):
        return "linear", module.in_features, module.out_features
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return "embedding", module.num_embeddings, module.embedding_dim
    if is_hf_conv1d(module):
        return "linear", module.weight.shape[0], module.weight.shape[1]
    return None


def layer_from_layout(name: str, layout: dict, dense: nn.Module) -> TensorizedLayer:
    """An uninitialised layer of the saved ``layout`` in place of ``dense`` (same device and
    dtype); its values come from the checkpoint that held the layout."""
    found = _dense_features(dense)
    fmt = layout.get("format")
    if fmt == TT_EMBEDDING:
        wanted = ("embedding", layout["num_embeddings"], layout["embedding_dim"])
    elif fmt in LINEAR_CLASSES:
        wanted = ("linear", layout["in_features"], layout["out_features"])
    else:
        raise ValueError(f"checkpoint layer '{name}' has an unknown format {fmt!r}")
    if found != wanted:
        what = type(dense).__name__ if found is None else f"{found[0]} {found[1:]}"
        raise ValueError(
            f"checkpoint tensorized '{name}' as a {wanted[0]} {wanted[1:]} ({fmt}), but the "
            f"model has {what} there; pass a model built with the configuration that was saved"
        )
    weight = dense.weight
    kwargs = dict(ranks=layout["ranks"][1:-1], threshold=layout.get("threshold", DEFAULT_THRESHOLD),
                  device="meta", dtype=weight.dtype)
    if fmt == TT_EMBEDDING:
        layer = TTEmbedding(
            wanted[1], wanted[2], padding_idx=dense.padding_idx,
            mode=getattr(dense, "mode", None) if isinstance(dense, nn.EmbeddingBag) else None,
            row_modes=layout["row_modes"], col_modes=layout["col_modes"],
            include_last_offset=bool(getattr(dense, "include_last_offset", False)),
            sparse=bool(getattr(dense, "sparse", False)),
            cache_rows=layout.get("cache_rows", 0), **kwargs,
        )
    else:
        cls = LINEAR_CLASSES[fmt]
        bias = layout.get("bias", getattr(dense, "bias", None) is not None)
        layer = cls(wanted[1], wanted[2], in_modes=layout["in_modes"],
                    out_modes=layout["out_modes"], bias=bias, **kwargs)
    layer = layer.to_empty(device=weight.device if not weight.is_meta else "cpu")
    layer.train(dense.training)
    return layer


def apply_layouts(model: nn.Module, layouts: dict[str, dict]) -> None:
    """Re-apply a saved rewrite: put an empty layer of each saved layout where the dense
    layer is (under all its names). Layers already tensorized are resized to the saved
    ranks (a layer of other modes raises ``LayoutMismatchError`` naming both layouts)."""
    order = {SPLIT_ATTENTION: 0, TIED_HEAD: 2}  # attention split first, heads tied last
    for name, layout in sorted(layouts.items(), key=lambda kv: order.get(kv[1]["format"], 1)):
        try:
            current = model.get_submodule(name)
        except AttributeError:
            raise ValueError(
                f"checkpoint has a tensorized layer '{name}' that the model lacks; pass a "
                "model built with the configuration that was saved"
            ) from None
        if isinstance(current, (TensorizedLayer, SplitMultiheadAttention, TiedEmbeddingHead)):
            if isinstance(current, TensorizedLayer):
                current._adopt_layout(layout)
            continue
        if layout["format"] == TIED_HEAD:
            embedding = model.get_submodule(layout["embedding"])
            if not isinstance(current, nn.Linear) or not isinstance(embedding, TTEmbedding):
                raise ValueError(f"checkpoint ties '{name}' to the embedding "
                                 f"'{layout['embedding']}', which this model cannot; pass a "
                                 "model built with the configuration that was saved")
            tie_head(model, name, embedding, layout["embedding"])
            continue
        if layout["format"] == SPLIT_ATTENTION:
            if not isinstance(current, nn.MultiheadAttention):
                raise ValueError(f"checkpoint has an attention at '{name}' where the model has "
                                 f"{type(current).__name__}; pass a model built with the "
                                 "configuration that was saved")
            layer = SplitMultiheadAttention(current)
        else:
            layer = layer_from_layout(name, layout, current)
        same = [m for m in model.modules() if m is current or (
            type(m) is nn.Embedding and m.weight is getattr(current, "weight", None))]
        for module in same:  # embeddings sharing one table (T5) stay one layer
            for alias in names_of(model, module):
                set_module(model, alias, layer)
    _fix_fused_transformers(model)
    declare_shared_to_hf(model)


def rewrite(model: nn.Module, chosen: dict[str, tuple[Candidate, LayerSpec]], init: str = "random",
            device: torch.device | str = "cpu",
            grams: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """Swap every chosen layer (under each of its names) in place and return ``model``.
    Layers of a model on the meta device get their cores on ``device``; ``grams`` (input
    Grams by layer name) make ``init="dense"`` activation-aware."""
    check_init(init)
    grams = grams or {}
    for name, (cand, spec) in chosen.items():
        layer = build_layer(cand, spec, init, device, grams.get(name))
        layer.train(cand.module.training)
        for alias in (name, *cand.aliases):
            set_module(model, alias, layer)
        for head_name in cand.tied_heads:
            tie_head(model, head_name, layer, name)
    _fix_fused_transformers(model)
    declare_shared_to_hf(model)
    if isinstance(model, torch.fx.GraphModule):
        model.recompile()
    return model
