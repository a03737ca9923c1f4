"""Capture: get a graph of the model's forward to learn which layers it really calls.

``torch.fx.symbolic_trace`` gives a ``GraphModule`` we can rewrite in place. Many models do
not trace (Hugging Face models since transformers 5 removed its fx tracer, data-dependent
Python control flow), and a forward with optional arguments traces into a graph that freezes
their branches; for those the graph comes from ``torch.export`` (non-strict) and is used for
analysis only: the rewrite swaps modules in the model so it keeps its Python forward.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from comera_compile.passes.inputs import as_call, quiet_eval

FX, EXPORT, MODULES = "fx", "export", "modules"


@dataclass
class Capture:
    """The model to rewrite and what we learned about its forward."""

    model: nn.Module  # a GraphModule on the fx path, the model itself otherwise
    path: str  # "fx", "export" or "modules"
    reason: str  # why this path was taken
    called: set[str] | None  # qualified names of modules the forward runs; None = unknown


def shorten(exc: BaseException, limit: int = 160) -> str:
    """``"TypeError: first line of the message"``, cut to ``limit`` characters."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _optional_arguments(model: nn.Module) -> list[str]:
    params = inspect.signature(model.forward).parameters.values()
    return [p.name for p in params if p.default is not inspect.Parameter.empty]


def _with_descendants(model: nn.Module, names: set[str]) -> set[str]:
    """fx keeps torch.nn modules as leaves; the modules inside a called leaf run too."""
    called = set(names)
    for name in names:
        module = model.get_submodule(name)
        called.update(f"{name}.{sub}" for sub, _ in module.named_modules() if sub)
    return called


def trace_fx(model: nn.Module) -> tuple[torch.fx.GraphModule | None, str]:
    """``(graph_module, "")`` or ``(None, why not)``."""
    try:
        graph_module = torch.fx.symbolic_trace(model)
    except Exception as exc:  # any tracing failure sends us down the next path
        return None, f"torch.fx.symbolic_trace failed ({shorten(exc)})"
    optional = _optional_arguments(model)
    if optional:
        return None, (
            f"forward has optional arguments ({', '.join(optional)}) whose branches a "
            "symbolic trace would freeze"
        )
    return graph_module, ""


class _TensorOutputs(nn.Module):
    """Wraps a model so its outputs are plain tensors (HF outputs hold cache objects that
    ``torch.export`` cannot flatten); only the graph is used, never this module."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        leaves: list[torch.Tensor] = []

        def walk(value: Any) -> None:
            if isinstance(value, torch.Tensor):
                leaves.append(value)
            elif isinstance(value, dict):
                for v in value.values():
                    walk(v)
            elif isinstance(value, (list, tuple)):
                for v in value:
                    walk(v)

        walk(self.model(*args, **kwargs))
        return tuple(leaves)


def export_called(model: nn.Module, example_inputs: Any) -> set[str]:
    """Names of the modules that own at least one node of the exported graph."""
    args, kwargs = as_call(example_inputs)
    with quiet_eval(model):
        program = torch.export.export(_TensorOutputs(model), args, kwargs, strict=False)
    called: set[str] = set()
    for node in program.graph.nodes:
        for path, _ in (node.meta.get("nn_module_stack") or {}).values():
            if path.startswith("model."):
                called.add(path.removeprefix("model."))
    return called


def capture(model: nn.Module, example_inputs: Any = None, allow_fx: bool = True) -> Capture:
    """fx if the model traces; else torch.export for analysis; else a walk of its modules.

    ``allow_fx=False`` keeps the model's own object (rewriting in place needs it).
    """
    if allow_fx:
        graph_module, why_not_fx = trace_fx(model)
    else:
        graph_module, why_not_fx = None, "in place: layers are swapped in the model itself"
    if graph_module is not None:
        targets = {n.target for n in graph_module.graph.nodes if n.op == "call_module"}
        called = _with_descendants(graph_module, targets)
        return Capture(graph_module, FX, "torch.fx.symbolic_trace succeeded", called)
    if example_inputs is None:
        return Capture(
            model, MODULES, f"{why_not_fx}; no example_inputs to export with, so layers were "
            "found by walking named_modules()", None
        )
    try:
        called = export_called(model, example_inputs)
    except Exception as exc:
        return Capture(
            model, MODULES,
            f"{why_not_fx}; torch.export failed too ({shorten(exc)}); layers were found by "
            "walking named_modules()", None,
        )
    return Capture(model, EXPORT, f"{why_not_fx}; graph from torch.export (non-strict)", called)
