"""The pipeline of ``optimize``: capture -> candidates -> shapes -> select -> rewrite ->
report, run in that order on a model under one :class:`~comera_compile.config.CompressionConfig`.
Each step is a pass of its own module; this one only orders them and picks the format."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from comera_compile.formats import COLA, TT
from comera_compile.passes.attention import restore_untouched, split_attention
from comera_compile.passes.budget import parse_budget
from comera_compile.passes.candidates import find_candidates
from comera_compile.passes.capture import capture
from comera_compile.passes.choose import ALLOCATED_AS, AUTO, choose_formats
from comera_compile.passes.eligible import eligible_options, hold_token_ends, weigh_tables
from comera_compile.passes.fuse import fuse_captured
from comera_compile.passes.materialize import materialize, on_meta
from comera_compile.passes.order import reorder_tables
from comera_compile.passes.report import OptimizeReport, attach_report, layer_records
from comera_compile.passes.rewrite import rewrite
from comera_compile.passes.row_cache import CachePlan, plan_caches
from comera_compile.passes.select import BudgetUnreachable, select_layers
from comera_compile.passes.sensitivity import output_sensitivities
from comera_compile.passes.shapes import propagate_shapes
from comera_compile.passes.spectra import input_grams, output_weights
from comera_compile.passes.targets import check_layer_config, config_for


class Settings(Protocol):
    """What :func:`tensorize` reads of a ``CompressionConfig`` (``config.py`` builds and
    checks it; the passes sit below it and do not import it)."""

    budget: Any
    format: str | None
    init: str
    max_rank: int | None
    include: str | list[str] | None
    exclude: str | list[str] | None
    filter_fn: Callable[[nn.Module, str], bool] | None
    layer_config: dict[str, dict[str, Any]] | None
    objective: str
    autotune: bool
    fuse: bool
    device: str
    row_cache: float | str
    cache_warmup: int

    def to_dict(self) -> dict[str, Any]: ...


def _totals(model: nn.Module, macs: int | None) -> dict[str, int | None]:
    params = list(model.parameters())
    return {"params": sum(p.numel() for p in params),
            "bytes": sum(p.numel() * p.element_size() for p in params), "macs": macs}


FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def _check_dtypes(candidates) -> None:
    for cand in candidates:
        if cand.weight.dtype not in FLOAT_DTYPES:
            raise TypeError(
                f"'{cand.name}' has {cand.weight.dtype} weights; tensorized layers train "
                f"floating-point cores ({', '.join(str(d) for d in FLOAT_DTYPES)}): optimize "
                "the model before quantizing it, or cast it (model.float()) first"
            )


def tensorize(model: nn.Module, config: Settings, example_inputs: Any = None,
              inplace: bool = False) -> nn.Module:
    """What ``optimize`` does before compiling: capture the forward, find the candidate
    layers, select them and their ranks under ``config.budget``, swap them for tensorized
    layers (in a copy of ``model`` unless ``inplace``) and attach the report, which holds
    ``config``."""
    budget, init, max_rank = config.budget, config.init, config.max_rank
    include, exclude, layer_config = config.include, config.exclude, config.layer_config
    autotune, objective, device, fuse = (config.autotune, config.objective, config.device,
                                         config.fuse)
    filter_fn = config.filter_fn
    layer_format = config.format
    if layer_format is None:
        layer_format = default_format(init, example_inputs is not None)
    budget = parse_budget(budget)
    target = model if inplace else copy.deepcopy(model)
    attentions = split_attention(target)  # its projections become ordinary Linear layers
    captured = capture(target, example_inputs)  # analysis only: layers are swapped in target
    if fuse:  # the forward changes (one layer for the siblings): the result is the fx graph
        if inplace or captured.graph_exact:
            why = "inplace=True keeps the model object" if inplace else captured.graph_exact
            raise ValueError(f"fuse=True returns a fused torch.fx GraphModule, which needs an "
                             f"exact graph and inplace=False ({why}); pass fuse=False")
        fuse_captured(captured)
        target = captured.model
    candidates = find_candidates(target, captured.weight_reads)
    if not candidates:
        kinds = sorted({type(m).__name__ for m in target.modules() if m is not target})
        raise ValueError(
            "the model has no nn.Linear, nn.Embedding or nn.EmbeddingBag layer to tensorize "
            f"(it holds {', '.join(kinds) or 'no submodules'})"
        )
    _check_dtypes(candidates)
    shapes = None
    called = captured.called
    if example_inputs is not None:
        shapes = propagate_shapes(target, example_inputs, {c.name for c in candidates})
        called = shapes.called
    elif not captured.traced and budget is not None and budget.flops is not None:
        raise ValueError("a flops budget needs example_inputs; the model could not be traced "
                         "either, so pass example_inputs or make the model traceable")
    before = _totals(target, shapes.total_macs if shapes else None)

    def options_in(fmt: str) -> tuple[list, dict]:
        found, why = eligible_options(candidates, shapes.layers if shapes else None, called,
                                      include, exclude, filter_fn, layer_config,
                                      ALLOCATED_AS if fmt == AUTO else fmt, max_rank,
                                      named=config.format is not None,
                                      from_scratch=init == "random")
        if init == "random" and include is None and filter_fn is None:  # else the user chose
            hold_token_ends(found, target)
        return found, why

    options, skipped = options_in(layer_format)
    weights = grams = sensitivities = None
    if init == "dense" and on_meta(target):
        raise ValueError(
            "the model is on the meta device, so there is no weight to decompose with "
            "init='dense'; use init='random' (train from scratch) or build the model for real"
        )
    if init == "dense" and example_inputs is not None and budget is not None:
        weights = output_weights(target, example_inputs, [o.cand for o in options])
        sensitivities = output_sensitivities(target, example_inputs, [o.cand for o in options])
    if init == "dense" and example_inputs is not None:
        grams = input_grams(target, example_inputs, [o.cand for o in options])
    # tried in turn until one meets the budget: tables weighed by lookup frequency (low
    # rank), then in TT layouts (which compress further); the default format, then TT
    attempts = [(layer_format, True), (layer_format, False)]
    if config.format is None and layer_format != TT:  # CoLA's or low rank's rank-1 floor
        attempts += [(TT, True), (TT, False)]
    eligible = {layer_format: (options, skipped)}
    for fmt, weigh in attempts:
        if weigh and not grams:
            continue
        if fmt not in eligible:
            eligible[fmt] = options_in(fmt)
        options = [copy.copy(o) for o in eligible[fmt][0]]  # weigh_tables edits them
        skipped = dict(eligible[fmt][1])
        if weigh:
            weigh_tables(options, grams, max_rank)
        try:
            selection = select_layers(options, skipped, budget, before, max_rank, init,
                                      weights, grams, sensitivities)
        except BudgetUnreachable:
            if (fmt, weigh) == attempts[-1]:
                raise
            continue
        layer_format = fmt
        caches = plan_caches(selection.chosen, _example_ids(shapes), config.row_cache)
        if caches.params:  # the caches' parameters come out of the budget: choose again
            try:
                selection = select_layers(options, skipped, budget, before, max_rank, init,
                                          weights, grams, sensitivities,
                                          reserve=caches.reserve(selection.chosen))
            except BudgetUnreachable:
                caches = CachePlan({}, {n: "no hot-row cache: the budget cannot spare it"
                                        for n in caches.params})
        break
    # recommender tables: the cheapest layout per row at the parameters they were given
    user_set = {o.cand.name for o in options if o.configured}
    selection.order_reasons.update(reorder_tables(selection.chosen, user_set, max_rank))
    if layer_format == AUTO and grams:
        configured = check_layer_config(layer_config)
        keep = {o.cand.name for o in options
                if "format" in (config_for(o.cand.name, configured) or {})}
        selection.order_reasons.update(choose_formats(selection.chosen, grams, keep))
    restore_untouched(target, attentions, selection.chosen, selection.skipped)
    rewrite(target, selection.chosen, init, device, grams)
    if on_meta(target):
        materialize(target, device)
    for name, rows in caches.params.items():
        if name in selection.chosen:
            target.get_submodule(name).set_cache(rows, config.cache_warmup)
    for name in selection.chosen:
        layer = target.get_submodule(name)
        layer.autotune, layer.objective = autotune, objective
    originals = layer_records(target, selection, init)
    report = OptimizeReport(captured.path, captured.reason, None if budget is None else str(budget),
                            selection.rank, init, before, originals, selection.skipped,
                            _returned(target, captured.graph_exact))
    report.config = config.to_dict()
    report.caches = {n: why for n, why in caches.reasons.items() if n in selection.chosen}
    attach_report(target, report)
    return target


def _example_ids(shapes: Any) -> dict[str, torch.Tensor]:
    """The ids each table looked up in the example forward, where they were real."""
    if shapes is None:
        return {}
    return {name: s.ids for name, s in shapes.layers.items() if s.ids is not None}


def default_format(init: str, has_examples: bool) -> str:
    """The format ``format=None`` means: from scratch CoLA (the format that pays in
    pretraining); pretrained weights with example inputs, each layer's format by output
    error; pretrained weights alone, TT (its SVD start is exact at full rank)."""
    if init == "random":
        return COLA
    return AUTO if has_examples else TT


def _returned(model: nn.Module, graph_exact: str) -> str:
    """What the summary says about the returned module's form."""
    if isinstance(model, torch.fx.GraphModule):
        return "GraphModule: fuse=True merged sibling layers, so the forward itself changed"
    what = f"{type(model).__name__}, the model's own class with the chosen layers swapped"
    if graph_exact:
        return f"{what} (a torch.fx GraphModule would not be exact: {graph_exact})"
    return f"{what} (a GraphModule is exact for this model: comera_compile.to_graph_module)"


