"""``compile_model``: torch.compile with the comera backend and the settings it wants."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

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


def compile_model(model: nn.Module, options: CompileOptions | None = None, *,
                  dynamic: bool | None = None, inplace: bool = False, measure: bool = False,
                  **fields: Any) -> nn.Module:
    """``torch.compile(model, backend="comera", dynamic=dynamic, options=...)``.

    Options come as a ``CompileOptions`` or as the backend's keywords, not both, checked
    here. ``inplace=True`` compiles in place and returns the model; in place only,
    ``measure=True`` keeps the compiled form only where timed steps show it faster.
    """
    if options is not None and fields:
        raise ValueError(f"compile_model takes a CompileOptions or keyword options, not "
                         f"both (got {sorted(fields)} beside it); set them on the "
                         "CompileOptions")
    if options is None:  # the backend's dict, and the two options of in-place compiles
        placed = {name: fields.pop(name) for name in ("blocks", "symbolic_ranks")
                  if name in fields}
        options = dataclasses.replace(CompileOptions.from_backend_options(fields), **placed)
    if not isinstance(options, CompileOptions):
        raise TypeError(f"compile_model's second argument is a CompileOptions, got "
                        f"{type(options).__name__}")
    CompileOptions.from_backend_options(options)  # inductor's entries checked now
    blocks, symbolic_ranks = options.blocks, options.symbolic_ranks
    backend_options = options.to_backend_options() or None
    # every prune and every new batch size is one more graph: leave room for a training run
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
    if measure and not inplace:
        raise ValueError("measure=True acts on a model compiled in place: pass inplace=True")
    if blocks and not inplace:
        raise ValueError("blocks=True compiles the model's blocks in place: pass inplace=True")
    if not inplace:
        return torch.compile(model, backend="comera", dynamic=dynamic, options=backend_options)

    def comera(fn: Any) -> Any:
        return torch.compile(fn, backend="comera", dynamic=dynamic, options=backend_options)

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
