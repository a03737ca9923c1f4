"""The public entry points: ``optimize`` (one call from a dense model to a tensorized one),
``Budget``, ``summary``, and ``save`` / ``load`` (re-exported from ``comera_compile.io``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from comera_compile.config import CompileOptions, CompressionConfig, config_of
from comera_compile.formats import positive_ints
from comera_compile.io import load, save
from comera_compile.nn import tensorized_layers
from comera_compile.passes import (
    Budget,
    Summary,
    exact_graph_module,
    report_of,
    summary,
    tensorize,
)
from comera_compile.planner import PlanReport

__all__ = ["Budget", "CompileOptions", "CompressionConfig", "Summary", "config_of", "load",
           "optimize", "plans", "save", "summary", "to_graph_module"]


def optimize(model: nn.Module, config: CompressionConfig | float | int | str | Budget | None = None,
             *, budget: float | int | str | Budget | None = None, format: str | None = None,
             init: str | None = None, compile: bool | str | None = None, example_inputs: Any = None,
             inplace: bool = False) -> nn.Module:
    """Tensorize the Linear / Embedding / EmbeddingBag layers of ``model`` as ``config`` (a
    :class:`~comera_compile.config.CompressionConfig`, which holds every setting and its
    default) says.

    ``budget``, ``format``, ``init`` and ``compile`` are shortcuts over the config's fields
    of those names: one left at None means "as the config says". A budget given where the
    config goes (``optimize(model, 0.25)``, ``optimize(model, Budget(ratio=40))``) is read
    as ``budget``. The config ends up in the model's report and in its checkpoint
    (:func:`~comera_compile.config.config_of`).

    Returns a copy of ``model`` of the same class, with the chosen layers swapped for
    tensorized ones: its methods, attributes, ``isinstance`` and ``train()`` / ``eval()`` all
    hold. ``model`` is left untouched unless ``inplace=True`` (layers swapped in ``model``
    itself). The fx graph is only how the passes read the forward; ``to_graph_module(result)``
    returns a ``torch.fx.GraphModule`` where one is exact (the summary says whether).
    ``example_inputs`` (a tensor, a tuple, or a dict of keyword inputs) lets the passes see
    the forward: layers it never calls stay dense, and flops budgets become possible.
    ``summary(result)`` tells what happened.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"optimize takes an nn.Module, got {type(model).__name__}")
    if config is not None and not isinstance(config, CompressionConfig):
        if isinstance(config, dict) or budget is not None:
            raise TypeError(f"config must be a CompressionConfig, got {type(config).__name__}")
        budget, config = config, None  # optimize(model, 0.25): a budget where config goes
    shortcuts = {"budget": budget, "format": format, "init": init, "compile": compile}
    given = {name: value for name, value in shortcuts.items() if value is not None}
    config = dataclasses.replace(config or CompressionConfig(), **given)  # checked again
    return _compiled(tensorize(model, config, example_inputs, inplace), config, example_inputs)


def _compiled(target: nn.Module, config: CompressionConfig, example_inputs: Any) -> nn.Module:
    """``target`` compiled in place as ``config.compile`` says (the class is kept), its
    blocks first wrapped for bond recomputation where ``config.recompute`` asks for it
    (``"auto"``: where it pays on the example batch; the model's report records what was
    decided, so a saved model loads back the same)."""
    from comera_compile.compile import bond_recompute
    from comera_compile.training.causal_loss import use_lean_causal_loss

    use_lean_causal_loss(target)
    recompute = config.recompute
    if recompute == "auto":
        recompute = "bonds" if example_inputs is not None and bond_recompute.recompute_pays(
            target, example_inputs) else None
    report = report_of(target)
    if report is not None:
        report.recompute = recompute
    if recompute == "bonds":
        bond_recompute.recompute_bonds(target)
        if config.compile_options.host_memory == "auto":
            from comera_compile.compile.cpu.host_memory import cache_for_training

            cache_for_training(target)
    if config.compile:
        from comera_compile.compile import compile_model  # imports inductor: on demand

        compile_model(target, config.compile_options, inplace=True,
                      measure=config.compile is True)
    return target


def to_graph_module(model: nn.Module) -> torch.fx.GraphModule:
    """The model as a ``torch.fx.GraphModule`` (tensorized layers kept as leaf modules), for
    graph passes of your own. Refused where the graph would not be exact: a forward that
    reads ``self.training`` or has optional arguments, or one that does not trace. The
    GraphModule shares the model's submodules and parameters."""
    model = getattr(model, "_orig_mod", model)
    graph_module, why_not = exact_graph_module(model)
    if graph_module is None:
        raise ValueError(f"no exact GraphModule for {type(model).__name__}: {why_not}; use "
                         "the module optimize returned (it behaves the same in every mode)")
    return graph_module


def plans(model: nn.Module, batch_sizes: list[int] | tuple[int, ...] = (1, 32, 4096),
          dtype: torch.dtype | None = None) -> PlanReport:
    """The contraction order every tensorized layer runs at each batch size (rows of input,
    or ids for an embedding), with its multiply-adds against the dense layer's.

    ``str()`` of the result is a table; ``.to_json(path)`` writes the records.
    """
    layers = tensorized_layers(model)
    if not layers:
        raise ValueError("the model has no tensorized layer; run comera_compile.optimize first")
    sizes = positive_ints("batch_sizes", batch_sizes)
    return PlanReport(
        [layer.plan_record(name, b, dtype=dtype) for name, layer in layers.items() for b in sizes]
    )
