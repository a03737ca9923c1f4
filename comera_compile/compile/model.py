"""``compile_model``: torch.compile with the comera backend and the settings it wants."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from comera_compile.compile.options import parse_options
from comera_compile.compile.policy.blocks import (
    BlockCompile,
    repeated_blocks,
    shared_blocks,
    why_not_blocks,
)
from comera_compile.compile.policy.measured import MeasuredCompile
from comera_compile.compile.policy.rank_dims import SymbolicRanks
from comera_compile.config import CompileOptions

RECOMPILE_LIMIT = 64


def compile_model(
    model: nn.Module,
    config: CompileOptions | None = None,
    *,
    dynamic: bool | None = None,
    inplace: bool = False,
    in_place: bool | None = None,
    measure: bool = False,
    blocks: bool | None = None,
    symbolic_ranks: bool | None = None,
    **options: Any,
) -> nn.Module:
    """``torch.compile(model, backend="comera", dynamic=dynamic, options=options)``.

    The backend's options come as a :class:`~comera_compile.config.CompileOptions`
    (``compile_model(model, CompileOptions(memory="low"))``) or as keywords
    (``compile_model(model, memory="low")``), not both.

    ``dynamic=None`` (torch's automatic dynamic shapes): the first batch size compiles a
    static graph; when another one arrives, the batch dimension turns symbolic and the
    tensorized ops guard it to its plan region (the power-of-two buckets of the rows that
    one plan serves, ``planner.regions``), so there is one graph per region, not one per
    batch size. Options are checked here, before the first call, so a typo fails at once
    rather than on the first forward. ``inplace=True`` compiles the model in place, as
    ``model.compile`` does (see :func:`_entry`), and returns ``model`` itself (its class
    is kept). ``measure=True`` (in place only) times the first training (and inference)
    steps compiled against eager and keeps the faster (``compile.policy.measured``).
    ``blocks`` (in place only): compile the model's repeated blocks, one graph for blocks
    of equal shapes, and run the rest eager (``compile.policy.blocks``: the first compile grows far
    less with depth); None: where each graph would serve three blocks or more
    (``compile.policy.blocks.blocks_pay``, ranks apart where they are symbolic), and the whole
    model otherwise; True: the blocks, or an
    error where there are none; False: the whole model. A ``CompileOptions`` carries it as
    ``blocks``. ``symbolic_ranks`` (in place only): True: the graphs keep the TT layers'
    rank bonds symbolic, so a rank cut or a block of other ranks needs no new graph
    (``compile.policy.rank_dims``); False: graphs specialised to the ranks (faster steps, a
    recompile per cut); None: symbolic where a measured compile learns that the run will
    cut ranks (``MeasuredCompile.expect_cuts``), else static. A ``CompileOptions``
    carries it too.
    ``memory="low"`` recomputes cheap activations in backward (see ``BackendOptions``).
    Raises dynamo's (global) recompile limit to ``RECOMPILE_LIMIT``: rank pruning changes
    core shapes, and each change is a recompile that must not push the model to eager.
    """
    if isinstance(config, bool):  # the old second positional argument
        warnings.warn("compile_model(model, dynamic) positionally is deprecated: pass "
                      "dynamic= by name (the second argument is a CompileOptions)",
                      DeprecationWarning, stacklevel=2)
        config, dynamic = None, config
    if in_place is not None:
        warnings.warn("compile_model(in_place=) is renamed inplace=, as optimize(inplace=) "
                      "and torch's own in-place flags spell it", DeprecationWarning,
                      stacklevel=2)
        inplace = in_place
    if config is not None:
        if options:
            raise ValueError(f"compile_model takes a CompileOptions or keyword options, not "
                             f"both (got {sorted(options)} beside it); set them on the "
                             "CompileOptions")
        if not isinstance(config, CompileOptions):
            raise TypeError(f"compile_model's second argument is a CompileOptions, got "
                            f"{type(config).__name__}")
        options = config.to_backend_options()
        blocks = config.blocks if blocks is None else blocks
        symbolic_ranks = config.symbolic_ranks if symbolic_ranks is None else symbolic_ranks
    parse_options(options)
    # every prune and every new batch size is one more graph: leave room for a training run
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
    if measure and not inplace:
        raise ValueError("measure=True acts on a model compiled in place: pass inplace=True")
    if blocks and not inplace:
        raise ValueError("blocks=True compiles the model's blocks in place: pass inplace=True")
    if not inplace:
        return torch.compile(model, backend="comera", dynamic=dynamic, options=options or None)

    def comera(fn: Any) -> Any:
        return torch.compile(fn, backend="comera", dynamic=dynamic, options=options or None)

    # as nn.Module.compile: the model keeps its class, attributes and methods
    found = repeated_blocks(model) if blocks is not False else []
    if blocks and not found:
        raise ValueError(
            f"blocks=True: {type(model).__name__} has no stack of repeated blocks holding "
            "tensorized layers (an nn.ModuleList or nn.Sequential of two or more modules "
            "of one class); pass blocks=None or False to compile the whole model")
    per_block = SymbolicRanks(model, BlockCompile(model, found, comera)) if found else None
    whole = SymbolicRanks(model, comera(_entry(model)))
    if measure:  # blocks and ranks are decided at the first compiled call
        model._compiled_call_impl = MeasuredCompile(
            model, whole, blocks=per_block, blocks_required=bool(blocks),
            symbolic_ranks=symbolic_ranks)
        return model
    symbolic = bool(symbolic_ranks)
    if per_block is not None and (blocks or not why_not_blocks(found, symbolic)):
        if not blocks:  # the default: blocks of shapes few share run eager
            per_block.select(shared_blocks(found, symbolic))
        whole = per_block
    whole.enabled = symbolic
    model._compiled_call_impl = whole
    return model


def _entry(model: nn.Module):
    """The frame an in-place compile starts tracing from. ``nn.Module.compile`` compiles
    ``_call_impl`` itself, a frame in torch's own files, which dynamo skips: it then starts
    at the model's ``forward``, and when that too is torch's (``nn.TransformerEncoder``), at
    each submodule of ours separately, one graph (and its recompiles) per layer. This
    frame is ours, so dynamo traces the whole call, torch's modules inlined, as one graph."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return model._call_impl(*args, **kwargs)

    return call
