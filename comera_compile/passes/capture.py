"""Capture: get a graph of the model's forward to learn which layers it really calls."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from comera_compile.nn import LEAF_MODULES
from comera_compile.passes.inputs import as_call, quiet_eval

FX, EXPORT, MODULES = "fx", "export", "modules"


@dataclass
class Capture:
    """The model to rewrite and what we learned about its forward."""

    model: nn.Module  # a GraphModule on the fx path, the model itself otherwise
    path: str  # "fx", "export" or "modules"
    reason: str  # why this path was taken
    called: set[str] | None  # qualified names of modules the forward runs; None = unknown
    graph_exact: str = "not traced"  # "" when a GraphModule is exact, else why it is not
    # modules whose weight the forward reads directly (F.linear(x, self.lin.weight)), not
    # only through their own call: a tensorized layer has no dense weight to give
    weight_reads: set[str] = field(default_factory=set)

    @property
    def traced(self) -> bool:
        """Whether a graph of the forward was read (fx or export), not just its modules."""
        return self.path != MODULES


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


class LeafTracer(torch.fx.Tracer):
    """fx's tracer, with our layers (and anything holding our layers' plans) kept as leaves:
    their forward picks a contraction plan per batch size, which a graph must not freeze."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, LEAF_MODULES) or super().is_leaf_module(m, qualname)


def _trace(model: nn.Module) -> torch.fx.GraphModule:
    tracer = LeafTracer()
    graph = tracer.trace(model)
    return torch.fx.GraphModule(tracer.root, graph, type(model).__name__)


def _mode_dependence(model: nn.Module, graph_module: torch.fx.GraphModule) -> str:
    """"" if tracing in the other mode gives the same graph, else why the graph is not exact."""
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.train(not model.training)
        other = _trace(model)
    except Exception as exc:
        return f"tracing in the other mode failed ({shorten(exc)})"
    finally:
        for module, mode in modes:
            module.training = mode
    if other.code != graph_module.code:
        return ("the forward reads self.training (the traced graph differs between train() "
                "and eval()), so a GraphModule would freeze the mode it was traced in")
    return ""


def trace_fx(model: nn.Module) -> tuple[torch.fx.GraphModule | None, str]:
    """``(graph_module, "")`` or ``(None, why not)``."""
    try:
        graph_module = _trace(model)
    except Exception as exc:  # any tracing failure sends us down the next path
        return None, f"torch.fx.symbolic_trace failed ({shorten(exc)})"
    optional = _optional_arguments(model)
    if optional:
        return None, (f"forward has optional arguments ({', '.join(optional)}) whose branches a "
                      "symbolic trace would freeze")
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


METADATA_READS = {"shape", "dtype", "device", "ndim", "size", "dim", "is_floating_point"}


def _metadata_only(node: torch.fx.Node) -> bool:
    """Whether every use of ``node`` asks only for its description (``w.shape``,
    ``w.dtype``, ``w.size(0)``), which a tensorized layer's ``.weight`` still answers."""
    for user in node.users:
        if user.op == "call_method" and user.target in METADATA_READS:
            continue
        if (user.op == "call_function" and user.target is getattr
                and user.args[1] in METADATA_READS):
            continue
        return False
    return True


def _fx_weight_reads(graph_module: torch.fx.GraphModule) -> set[str]:
    """Modules whose ``weight`` the graph computes with outside their own call (a
    ``get_attr`` node used for more than its shape or dtype): fx keeps Linear and Embedding
    as leaves, so such a read shows. A layer fx traces through (a Hugging Face Conv1D) reads
    its own weight inside its call: that read is the layer's, not the forward's."""
    found = set()
    for node in graph_module.graph.nodes:
        if node.op == "get_attr" and not _metadata_only(node):
            module, _, attr = node.target.rpartition(".")
            if attr == "weight" and not _inside(module, node):
                found.add(module)
    return found


def _inside(module: str, node: torch.fx.Node) -> bool:
    """Whether ``node`` and every node using it were traced inside ``module``'s call."""
    for each in (node, *node.users):
        stack = {path for path, _ in (each.meta.get("nn_module_stack") or {}).values()}
        if module not in stack:
            return False
    return True


def _owners(model: nn.Module) -> dict[int, set[str]]:
    """Parameter identity -> names of every module that holds it (tied weights have many)."""
    owners: dict[int, set[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), set()).add(name)
    return owners


def _export_weight_reads(program: Any, model: nn.Module) -> set[str]:
    """Modules whose ``weight`` a node outside every module holding it uses."""
    params = dict(model.named_parameters(remove_duplicate=False))
    owners = _owners(model)
    found: set[str] = set()
    inputs = program.graph_signature.inputs_to_parameters
    for node in program.graph.nodes:
        fqn = inputs.get(node.name) if node.op == "placeholder" else None
        if fqn is None or not fqn.endswith("weight"):
            continue
        param = params.get(fqn.removeprefix("model."))
        holders = owners.get(id(param), set()) if param is not None else set()
        for user in node.users:
            stack = {path.removeprefix("model.") for path, _ in
                     (user.meta.get("nn_module_stack") or {}).values()}
            if holders and not holders & stack:
                found.update(holders)
    return found


def _forget_export_graph() -> None:
    """Drop the map from fake tensors to graph nodes that torch keeps at module level after
    an export: it holds the last exported graph, its fake tensors and shape environment
    alive for the rest of the process, memory the caller's training would pay for."""
    from torch.fx.experimental import proxy_tensor

    table = getattr(proxy_tensor, "_FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT", None)
    if isinstance(table, dict):
        table.clear()


def export_called(model: nn.Module, example_inputs: Any) -> tuple[set[str], set[str]]:
    """Names of the modules that own at least one node of the exported graph, and of those
    whose weight is read outside their own call."""
    args, kwargs = as_call(example_inputs)
    try:
        with quiet_eval(model):
            program = torch.export.export(_TensorOutputs(model), args, kwargs, strict=False)
    finally:
        _forget_export_graph()
    called: set[str] = set()
    for node in program.graph.nodes:
        for path, _ in (node.meta.get("nn_module_stack") or {}).values():
            if path.startswith("model."):
                called.add(path.removeprefix("model."))
    return called, _export_weight_reads(program, model)


def exact_graph_module(model: nn.Module) -> tuple[torch.fx.GraphModule | None, str]:
    """``(graph_module, "")`` when a traced GraphModule behaves as ``model`` in every mode,
    else ``(None, why not)``. The GraphModule shares ``model``'s submodules and parameters."""
    graph_module, why_not = trace_fx(model)
    if graph_module is None:
        return None, why_not
    why_not = _mode_dependence(model, graph_module)
    return (None, why_not) if why_not else (graph_module, "")


def capture(model: nn.Module, example_inputs: Any = None) -> Capture:
    """fx if the model traces; else torch.export; else a walk of its modules."""
    graph_module, why_not_fx = trace_fx(model)
    if graph_module is not None:
        targets = {n.target for n in graph_module.graph.nodes if n.op == "call_module"}
        called = _with_descendants(graph_module, targets)
        return Capture(graph_module, FX, "torch.fx.symbolic_trace succeeded", called,
                       _mode_dependence(model, graph_module), _fx_weight_reads(graph_module))
    if example_inputs is None:
        return Capture(
            model, MODULES, f"{why_not_fx}; no example_inputs to export with, so layers were "
            "found by walking named_modules()", None, why_not_fx
        )
    try:
        called, weight_reads = export_called(model, example_inputs)
    except Exception as exc:
        return Capture(
            model, MODULES,
            f"{why_not_fx}; torch.export failed too ({shorten(exc)}); layers were found by "
            "walking named_modules()", None, why_not_fx,
        )
    return Capture(model, EXPORT, f"{why_not_fx}; graph from torch.export (non-strict)", called,
                   why_not_fx, weight_reads)
