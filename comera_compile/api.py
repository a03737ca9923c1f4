"""The public entry points: ``optimize`` (one call from a dense model to a tensorized one),
``Budget``, ``summary``, and ``save`` / ``load`` (re-exported from ``comera_compile.io``)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from comera_compile.io import load, save
from comera_compile.nn import tensorized_layers
from comera_compile.passes import (
    Budget,
    OptimizeReport,
    Summary,
    capture,
    eligible_options,
    find_candidates,
    parse_budget,
    propagate_shapes,
    rewrite,
    select_layers,
    summary,
)
from comera_compile.passes.capture import MODULES
from comera_compile.passes.fuse import fuse_captured
from comera_compile.passes.report import REPORT_ATTR, record_original
from comera_compile.passes.rewrite import INITS
from comera_compile.passes.specs import LINEAR_FORMATS
from comera_compile.planner import PlanReport, parse_objective

__all__ = ["Budget", "Summary", "load", "optimize", "plans", "save", "summary"]


def _totals(model: nn.Module, macs: int | None) -> dict[str, int | None]:
    params = list(model.parameters())
    return {
        "params": sum(p.numel() for p in params),
        "bytes": sum(p.numel() * p.element_size() for p in params),
        "macs": macs,
    }


def _check_arguments(model, init, format, max_rank, objective) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"optimize takes an nn.Module, got {type(model).__name__}")
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    if format not in LINEAR_FORMATS:
        raise ValueError(f"format must be one of {LINEAR_FORMATS}, got {format!r}")
    if max_rank is not None and (
        isinstance(max_rank, bool) or not isinstance(max_rank, int) or max_rank < 1
    ):
        raise ValueError(f"max_rank must be a positive int or None, got {max_rank!r}")
    parse_objective(objective)


def optimize(
    model: nn.Module,
    budget: float | int | str | Budget | None = None,
    *,
    example_inputs: Any = None,
    include: str | list[str] | None = None,
    exclude: str | list[str] | None = None,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    layer_config: dict[str, dict[str, Any]] | None = None,
    init: str = "random",
    format: str = "tt",
    max_rank: int | None = None,
    compile: bool = True,
    autotune: bool = False,
    inplace: bool = False,
    objective: str = "combo",
    memory: str | float = "default",
    fuse: bool = False,
) -> nn.Module:
    """Tensorize the Linear / Embedding / EmbeddingBag layers of ``model`` to meet ``budget``.

    Returns a new module (a ``torch.fx.GraphModule`` when the model traces) and leaves
    ``model`` untouched unless ``inplace=True`` (which swaps layers in ``model`` itself).
    ``example_inputs`` (a tensor, a tuple, or a dict of keyword inputs) lets the passes see
    the forward: layers it never calls stay dense, and flops budgets become possible.
    ``init="dense"`` starts from a TT-SVD of the current weights (for pretrained models);
    ``"random"`` trains from scratch, as CoMERA does. ``summary(result)`` tells what happened.
    ``compile=True`` (the default) wraps the result in ``torch.compile(backend="comera")``
    (compiled on the first call, once per batch size and per rank change); ``compile=False``
    returns the eager module. ``autotune=True`` times the best few contraction orders of
    each layer on first use; ``objective`` is the planner's cost (cotengra's ``"combo"``).
    ``memory="low"`` (compiled models) recomputes cheap activations in backward: several
    times less training memory for a few percent more step time. ``fuse=True`` first merges
    sibling Linear layers that read the same input (Q/K/V) into one, so they tensorize into
    one chain and run one contraction.
    """
    _check_arguments(model, init, format, max_rank, objective)
    if memory != "default" and not compile:
        raise ValueError(f"memory={memory!r} acts while compiling; pass compile=True")
    budget = parse_budget(budget)
    work = model if inplace else copy.deepcopy(model)
    if inplace:  # a GraphModule would be a new object: swap modules in the model itself
        captured = capture(work, example_inputs, allow_fx=False)
    else:
        captured = capture(work, example_inputs)
    if fuse:
        fuse_captured(captured)
    target = captured.model
    candidates = find_candidates(target)
    if not candidates:
        kinds = sorted({type(m).__name__ for m in target.modules() if m is not target})
        raise ValueError(
            "the model has no nn.Linear, nn.Embedding or nn.EmbeddingBag layer to tensorize "
            f"(it holds {', '.join(kinds) or 'no submodules'})"
        )
    shapes = None
    called = captured.called
    if example_inputs is not None:
        shapes = propagate_shapes(target, example_inputs, {c.name for c in candidates})
        called = shapes.called
    elif captured.path == MODULES and budget is not None and budget.flops is not None:
        raise ValueError(
            "a flops budget needs example_inputs; the model could not be traced "
            "either, so pass example_inputs or make the model traceable"
        )
    before = _totals(target, shapes.total_macs if shapes else None)
    options, skipped = eligible_options(
        candidates,
        shapes.layers if shapes else None,
        called,
        include,
        exclude,
        filter_fn,
        layer_config,
        format,
        max_rank,
    )
    selection = select_layers(options, skipped, budget, before, max_rank)
    rewrite(target, selection.chosen, init)
    for name in selection.chosen:
        layer = target.get_submodule(name)
        layer.autotune, layer.objective = autotune, objective
    report = OptimizeReport(
        captured.path,
        captured.reason,
        None if budget is None else str(budget),
        selection.rank,
        init,
        before,
        {name: record_original(cand) for name, (cand, _) in selection.chosen.items()},
        selection.skipped,
    )
    setattr(target, REPORT_ATTR, report)
    if not compile:
        return target
    from comera_compile.compile import compile_model  # imports inductor: only when asked

    return compile_model(target, memory=memory)


def plans(
    model: nn.Module,
    batch_sizes: list[int] | tuple[int, ...] = (1, 32, 4096),
    dtype: torch.dtype | None = None,
) -> PlanReport:
    """The contraction order every tensorized layer runs at each batch size (rows of input,
    or ids for an embedding), with its multiply-adds against the dense layer's.

    ``str()`` of the result is a table; ``.to_json(path)`` writes the records.
    """
    layers = tensorized_layers(model)
    if not layers:
        raise ValueError("the model has no tensorized layer; run comera_compile.optimize first")
    sizes = [int(b) for b in batch_sizes]
    if not sizes or min(sizes) < 1:
        raise ValueError(f"batch_sizes must be positive ints, got {list(batch_sizes)}")
    return PlanReport(
        [layer.plan_record(name, b, dtype=dtype) for name, layer in layers.items() for b in sizes]
    )
