"""``compile_model``: torch.compile with the comera backend and the settings it wants."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from comera_compile.compile.measured import MeasuredCompile
from comera_compile.compile.options import parse_options

RECOMPILE_LIMIT = 64


def compile_model(
    model: nn.Module,
    dynamic: bool | None = None,
    in_place: bool = False,
    measure: bool = False,
    **options: Any,
) -> nn.Module:
    """``torch.compile(model, backend="comera", dynamic=dynamic, options=options)``.

    ``dynamic=None`` (torch's automatic dynamic shapes): the first batch size compiles a
    static graph; when another one arrives, the batch dimension turns symbolic and the
    tensorized ops guard it to its plan region (the power-of-two buckets of the rows that
    one plan serves, ``planner.regions``), so there is one graph per region, not one per
    batch size. Options are checked here, before the first call, so a typo fails at once
    rather than on the first forward. ``in_place=True`` compiles the model in place, as
    ``model.compile`` does (see :func:`_entry`), and returns ``model`` itself (its class
    is kept). ``measure=True`` (in place only) times the first training (and inference)
    steps compiled against eager and keeps the faster (``compile.measured``).
    ``memory="low"`` recomputes cheap activations in backward (see ``BackendOptions``).
    Raises dynamo's (global) recompile limit to ``RECOMPILE_LIMIT``: rank pruning changes
    core shapes, and each change is a recompile that must not push the model to eager.
    """
    parse_options(options)
    # every prune and every new batch size is one more graph: leave room for a training run
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
    if measure and not in_place:
        raise ValueError("measure=True acts on a model compiled in place: pass in_place=True")
    if in_place:  # as nn.Module.compile: the model keeps its class, attributes and methods
        compiled = torch.compile(
            _entry(model), backend="comera", dynamic=dynamic, options=options or None
        )
        model._compiled_call_impl = MeasuredCompile(model, compiled) if measure else compiled
        return model
    return torch.compile(model, backend="comera", dynamic=dynamic, options=options or None)


def _entry(model: nn.Module):
    """The frame an in-place compile starts tracing from. ``nn.Module.compile`` compiles
    ``_call_impl`` itself, a frame in torch's own files, which dynamo skips: it then starts
    at the model's ``forward``, and when that too is torch's (``nn.TransformerEncoder``), at
    each submodule of ours separately, one graph (and its recompiles) per layer. This
    frame is ours, so dynamo traces the whole call, torch's modules inlined, as one graph."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return model._call_impl(*args, **kwargs)

    return call
