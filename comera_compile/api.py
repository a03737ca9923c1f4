"""The public entry points: ``optimize`` (one call from a dense model to a tensorized one),
``Budget``, ``summary``, and ``save`` / ``load`` (re-exported from ``comera_compile.io``)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from comera_compile.config import CompileOptions, CompressionConfig, config_of
from comera_compile.formats import COLA, TT, positive_ints
from comera_compile.io import load, save
from comera_compile.nn import tensorized_layers
from comera_compile.passes import (
    ALLOCATED_AS,
    AUTO,
    Budget,
    BudgetUnreachable,
    OptimizeReport,
    Summary,
    attach_report,
    capture,
    check_layer_config,
    choose_formats,
    config_for,
    eligible_options,
    exact_graph_module,
    find_candidates,
    fuse_captured,
    input_grams,
    layer_records,
    materialize,
    on_meta,
    output_sensitivities,
    output_weights,
    parse_budget,
    propagate_shapes,
    restore_untouched,
    rewrite,
    select_layers,
    split_attention,
    summary,
    weigh_tables,
)
from comera_compile.planner import PlanReport

__all__ = [
    "Budget", "CompileOptions", "CompressionConfig", "Summary", "config_of", "load",
    "optimize", "plans", "save", "summary", "to_graph_module",
]


def _totals(model: nn.Module, macs: int | None) -> dict[str, int | None]:
    params = list(model.parameters())
    return {
        "params": sum(p.numel() for p in params),
        "bytes": sum(p.numel() * p.element_size() for p in params),
        "macs": macs,
    }


FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def _check_dtypes(candidates) -> None:
    for cand in candidates:
        if cand.weight.dtype not in FLOAT_DTYPES:
            raise TypeError(
                f"'{cand.name}' has {cand.weight.dtype} weights; tensorized layers train "
                f"floating-point cores ({', '.join(str(d) for d in FLOAT_DTYPES)}): optimize "
                "the model before quantizing it, or cast it (model.float()) first"
            )


_OPTIMIZE_DEFAULTS = {
    "budget": None, "format": None, "init": "random", "max_rank": None, "include": None,
    "exclude": None, "layer_config": None, "objective": "combo", "autotune": False,
    "fuse": False, "device": "cpu", "compile": True, "memory": "default", "host_memory": None,
}


def optimize(
    model: nn.Module,
    budget: float | int | str | Budget | CompressionConfig | None = None,
    *,
    config: CompressionConfig | None = None,
    example_inputs: Any = None,
    include: str | list[str] | None = None,
    exclude: str | list[str] | None = None,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    layer_config: dict[str, dict[str, Any]] | None = None,
    init: str = "random",
    format: str | None = None,
    max_rank: int | None = None,
    compile: bool | str = True,
    autotune: bool = False,
    inplace: bool = False,
    objective: str = "combo",
    memory: str | float = "default",
    host_memory: str | None = None,
    device: torch.device | str = "cpu",
    fuse: bool = False,
) -> nn.Module:
    """Tensorize the Linear / Embedding / EmbeddingBag layers of ``model`` to meet ``budget``.

    ``optimize(model, config)`` (or ``config=``) takes every setting from a
    :class:`~comera_compile.config.CompressionConfig`; the keyword arguments below are a
    front that builds one (a keyword set to anything but its default beside a config is
    refused; keywords at their defaults are ignored there). The config ends up in the model's
    report and in its checkpoint (:func:`~comera_compile.config.config_of`). Per call, not
    part of the config: ``example_inputs``, ``filter_fn`` and ``inplace``.
    ``budget``: a float in (0, 1] is the share of parameters to keep (``1.0``: all), a
    string ``"40x"`` or ``Budget(ratio=40)`` a compression ratio (40 times smaller), an int
    a parameter count (ints up to 100 are refused: they read like a share or a ratio).

    Returns a copy of ``model`` of the same class, with the chosen layers swapped for
    tensorized ones: its methods, attributes, ``isinstance`` and ``train()`` / ``eval()`` all
    hold. ``model`` is left untouched unless ``inplace=True`` (layers swapped in ``model``
    itself). The fx graph is only how the passes read the forward; ``to_graph_module(result)``
    returns a ``torch.fx.GraphModule`` where one is exact (the summary says whether).
    ``example_inputs`` (a tensor, a tuple, or a dict of keyword inputs) lets the passes see
    the forward: layers it never calls stay dense, and flops budgets become possible.
    ``init="dense"`` starts from a TT-SVD of the current weights (for pretrained models);
    ``"random"`` trains from scratch, as CoMERA does. ``summary(result)`` tells what happened.
    ``compile=True`` (the default) compiles the result in place, as
    ``Module.compile(backend="comera")`` does (the whole model as one graph, or, where it
    has a stack of repeated blocks, one graph for the blocks of equal shapes and the rest
    eager: ``compile.blocks``; then one graph per plan region of the batch size and per
    rank change; the class is kept). It runs eager until eager calls have taken as long as the best
    compiled step would need to repay a first compile (``compile.measured.WAIT_S``), so a
    short run never compiles; then it times training steps compiled against eager and
    keeps the faster, so compiling never leaves a model slower (``summary`` says which
    runs, with the measured ratio); ``compile="always"`` compiles at once, without timing;
    ``compile=False`` returns the eager module.
    ``format="auto"`` (with ``init="dense"`` and ``example_inputs``) sizes the layers in low
    rank, then gives each Linear layer the format (low rank, TT or TTM) of least output error
    at that size, and says why in the summary; without inputs it is low rank. The default
    (None): from scratch (``init="random"``) ``"cola"`` (TT where the budget is below its
    rank-1 floor); ``"auto"`` for ``init="dense"`` with ``example_inputs``; else ``"tt"``.
    A format you name is kept.
    ``format`` is ``"cola"`` (``silu(x U) V``, the format that pays in pretraining),
    ``"tt"`` (each layer's order, i.e. modes per side,
    is the one with the cheapest planned training step at the example batch, at equal
    parameters; ``layer_config`` can set ``order``), ``"ttm"``, or ``"lowrank"`` (``W = U V``:
    fastest per row, least accurate at high compression). ``autotune=True`` times the best
    few contraction orders of each layer on first use; ``objective`` is the planner's cost
    (cotengra's ``"combo"``). ``memory="low"`` (compiled models) recomputes the
    wide outputs of thin (rank-bond) products in backward and keeps dropout masks as bits:
    much less training memory for some more step time (``python benchmarks/step.py``
    measures both, row ``comera-compiled-low``); a
    number below 1 (``memory=0.05``) recomputes more, for less memory and more time.
    ``host_memory`` (compiled models on CPU): None or ``"off"`` (the default) leaves torch's
    CPU allocator and glibc's ``malloc`` settings alone. The other settings change the
    whole process, every model in it: ``"cache"`` keeps freed blocks of 1 MiB or more by
    size for the next step's requests of that size, ``"reuse"`` keeps freed memory in
    glibc's heap (both: large activations are not faulted in anew each step, for more
    resident memory), ``"release"`` unmaps freed blocks at once
    (``comera_compile.compile.host_memory``).
    A model built under ``torch.device("meta")`` (too big to build dense) takes
    ``init="random"``: cores are created on ``device`` and only the rest of the model (norms,
    layers left dense, buffers) is allocated there, so no dense weight of a swapped layer
    ever exists.
    ``fuse=True`` first merges sibling Linear layers that read the same input (Q/K/V,
    gate/up) into one, so they tensorize into one chain and run one contraction; the forward
    changes, so the result is then the fused ``torch.fx.GraphModule`` (the model must trace
    exactly).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"optimize takes an nn.Module, got {type(model).__name__}")
    if isinstance(budget, CompressionConfig):
        if config is not None:
            raise ValueError("optimize takes one CompressionConfig: as the second argument or "
                             "config=, not both")
        budget, config = None, budget
    keywords = {"budget": budget, "format": format, "init": init, "max_rank": max_rank,
                "include": include, "exclude": exclude, "layer_config": layer_config,
                "objective": objective, "autotune": autotune, "fuse": fuse,
                "device": device, "compile": compile}
    compile_keywords = {"memory": memory, "host_memory": host_memory}
    if config is None:
        if host_memory is not None and not compile:
            raise ValueError(f"host_memory={host_memory!r} acts while compiling; pass "
                             "compile=True")
        config = CompressionConfig(
            **keywords, compile_options=CompileOptions(**{
                k: v for k, v in compile_keywords.items() if v is not None}))
    else:
        if not isinstance(config, CompressionConfig):
            raise TypeError(f"config must be a CompressionConfig, got {type(config).__name__}")
        given = [name for name, value in {**keywords, **compile_keywords}.items()
                 if value is not None and value != _OPTIMIZE_DEFAULTS[name]]
        if given:
            raise ValueError(
                f"optimize got a CompressionConfig and the keyword(s) {given}; set them on "
                "the config instead (dataclasses.replace(config, ...))")
    return _optimize(model, config, example_inputs, filter_fn, inplace)


def _optimize(model: nn.Module, config: CompressionConfig, example_inputs: Any,
              filter_fn: Callable[[nn.Module, str], bool] | None, inplace: bool) -> nn.Module:
    """``optimize`` with its settings in ``config``."""
    budget, init, max_rank = config.budget, config.init, config.max_rank
    include, exclude, layer_config = config.include, config.exclude, config.layer_config
    autotune, objective, device, fuse = (config.autotune, config.objective, config.device,
                                         config.fuse)
    layer_format, compile_result = config.format, config.compile
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
    candidates = find_candidates(target)
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
        raise ValueError(
            "a flops budget needs example_inputs; the model could not be traced "
            "either, so pass example_inputs or make the model traceable"
        )
    before = _totals(target, shapes.total_macs if shapes else None)

    def options_in(fmt: str) -> tuple[list, dict]:
        return eligible_options(candidates, shapes.layers if shapes else None, called,
                                include, exclude, filter_fn, layer_config,
                                ALLOCATED_AS if fmt == AUTO else fmt, max_rank,
                                named=config.format is not None)

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
        break
    if layer_format == AUTO and grams:
        configured = check_layer_config(layer_config)
        keep = {o.cand.name for o in options
                if "format" in (config_for(o.cand.name, configured) or {})}
        selection.order_reasons.update(choose_formats(selection.chosen, grams, keep))
    restore_untouched(target, attentions, selection.chosen, selection.skipped)
    rewrite(target, selection.chosen, init, device, grams)
    if on_meta(target):
        materialize(target, device)
    for name in selection.chosen:
        layer = target.get_submodule(name)
        layer.autotune, layer.objective = autotune, objective
    originals = layer_records(target, selection, init)
    report = OptimizeReport(
        captured.path,
        captured.reason,
        None if parse_budget(budget) is None else str(parse_budget(budget)),
        selection.rank,
        init,
        before,
        originals,
        selection.skipped,
        _returned(target, captured.graph_exact),
    )
    report.config = config.to_dict()
    attach_report(target, report)
    if config.recompute == "bonds":
        from comera_compile.compile.bond_recompute import recompute_bonds

        recompute_bonds(target)
    if compile_result:  # in place (nn.Module.compile), so the result stays the user's class
        from comera_compile.compile import compile_model  # imports inductor: on demand

        compile_model(target, config.compile_options, inplace=True,
                      measure=compile_result is True)
    return target


def default_format(init: str, has_examples: bool) -> str:
    """The format ``format=None`` means.

    From scratch (``init="random"``): CoLA, low rank with SiLU on the bond, the format that
    pays in pretraining (it matches a dense model of equal parameters where TT and plain low
    rank trail it: ``benchmarks/pretrain.py``). Pretrained weights seen at work
    (``init="dense"`` with example inputs): each layer's own format by output error. Pretrained
    weights alone: TT, whose SVD start is exact at full rank.
    """
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
    sizes = positive_ints("batch_sizes", batch_sizes)
    return PlanReport(
        [layer.plan_record(name, b, dtype=dtype) for name, layer in layers.items() for b in sizes]
    )
