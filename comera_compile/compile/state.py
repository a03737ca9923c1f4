"""How a model runs with respect to the compiler, asked through one public function.

The trainer (when to cut ranks, whether a recompile pays) and the summary (what runs)
need to know whether a model runs compiled and how. They ask :func:`compiled_state`
rather than reading the private attribute ``torch.compile`` installs on a module
compiled in place (``_compiled_call_impl``). Nothing here imports dynamo or inductor: a
model can only be compiled once they are loaded.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from comera_compile.compile.policy.measured import MeasuredCompile


@dataclass(frozen=True)
class CompiledState:
    """``compiled``: training steps run through ``torch.compile`` (wrapped, or compiled in
    place; not where ``optimize``'s measured compile chose eager). ``cuts_recompile``: a
    rank cut makes them compile again (graphs at static ranks). ``description``: how the
    model runs, for ``summary`` (``""`` where nothing is compiled). ``measured``: the
    measured compile ``optimize`` installed (None otherwise), which a trainer tells how
    long the run is and asks whether a recompile pays."""

    compiled: bool
    cuts_recompile: bool
    description: str
    measured: MeasuredCompile | None


def _wrapped(model: nn.Module) -> bool:
    """Whether ``model`` is a ``torch.compile`` wrapper (dynamo loaded: else it cannot be)."""
    dynamo = sys.modules.get("torch._dynamo")
    return dynamo is not None and isinstance(model, dynamo.eval_frame.OptimizedModule)


def compiled_state(model: nn.Module) -> CompiledState:
    """How ``model`` (or the module a ``DistributedDataParallel`` wraps) runs compiled."""
    model = getattr(model, "module", model)
    if _wrapped(model):
        return CompiledState(True, True, "wrapped by torch.compile", None)
    impl: Any = getattr(model, "_compiled_call_impl", None)
    if impl is None:
        return CompiledState(False, False, "", None)
    compiled = bool(getattr(impl, "compiles_training", True))
    describe = getattr(impl, "describe", None)
    return CompiledState(
        compiled=compiled,
        cuts_recompile=compiled and bool(getattr(impl, "cuts_recompile", True)),
        description=describe() if describe is not None else "compiled in place (torch.compile)",
        measured=impl if hasattr(impl, "expect_cuts") else None,
    )
