"""Shapes: one no-grad run of the example inputs tells each layer's input shape, the rows per
call the planner will see, and the model's total multiply-adds."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from comera_compile.passes.capture import shorten
from comera_compile.passes.inputs import as_call, describe, quiet_eval


@dataclass
class LayerShape:
    """What one layer saw during the example forward."""

    input_shape: tuple[int, ...]  # first call
    rows: int  # rows per call: leading dims of a Linear input, number of ids of an embedding
    calls: int = 1
    total_rows: int = 0  # rows summed over calls (a shared layer runs more than once)
    ids: torch.Tensor | None = None  # an embedding's looked-up ids, where they are real


@dataclass
class ShapeInfo:
    layers: dict[str, LayerShape] = field(default_factory=dict)
    called: set[str] = field(default_factory=set)  # every module whose forward ran
    total_macs: int = 0  # matmul/conv multiply-adds of the whole forward


def _rows(module: nn.Module, x: torch.Tensor) -> int:
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return x.numel()
    return math.prod(x.shape[:-1])


def _real_ids(module: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and not x.is_meta and (
            not x.is_floating_point()):
        return x.detach().reshape(-1).cpu()
    return None


def _features_on_meta(model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """For a model on the meta device, float inputs go to meta too; integer ids stay real,
    so a table built on meta still sees which ids it looks up (its hot-row cache)."""
    if not any(t.is_meta for t in model.parameters()):
        return args, kwargs

    def meta(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.to("meta")
        return v

    return tuple(meta(a) for a in args), {k: meta(v) for k, v in kwargs.items()}


def propagate_shapes(model: nn.Module, example_inputs: Any,
                     layer_names: set[str] | None = None) -> ShapeInfo:
    """Run ``model`` once on ``example_inputs``; record shapes of ``layer_names`` (all if None)."""
    args, kwargs = _features_on_meta(model, *as_call(example_inputs))
    info = ShapeInfo()
    stack: list[str] = []
    names = {id(m): n for n, m in model.named_modules()}

    def pre_hook(module, inputs):
        name = names.get(id(module), "?")
        stack.append(name)
        info.called.add(name)
        wanted = layer_names is None or name in layer_names
        if wanted and inputs and isinstance(inputs[0], torch.Tensor):
            x = inputs[0]
            rows = _rows(module, x)
            seen = info.layers.get(name)
            ids = _real_ids(module, x)
            if seen is None:
                info.layers[name] = LayerShape(tuple(x.shape), rows, 1, rows, ids)
            else:
                seen.calls += 1
                seen.total_rows += rows
                if ids is not None and seen.ids is not None:
                    seen.ids = torch.cat([seen.ids, ids])

    def post_hook(module, inputs, output):
        if stack:
            stack.pop()

    handles = []
    for module in model.modules():
        handles.append(module.register_forward_pre_hook(pre_hook))
        handles.append(module.register_forward_hook(post_hook))
    counter = FlopCounterMode(display=False)
    try:
        with quiet_eval(model), counter:
            model(*args, **kwargs)
    except Exception as exc:
        where = ""
        if stack and stack[-1] not in ("", "?"):
            where = f" in module '{stack[-1]}' ({type(model.get_submodule(stack[-1])).__name__})"
        raise ValueError(
            f"example_inputs do not fit the model ({describe(args, kwargs)}): the forward "
            f"failed{where} with {shorten(exc, 300)}; pass inputs of the shape the model's "
            "forward expects"
        ) from exc
    finally:
        for handle in handles:
            handle.remove()
    info.total_macs = counter.get_total_flops() // 2
    return info
