"""How a model runs with respect to the compiler, asked through one public function."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from comera_compile.compile.policy.measured import MeasuredCompile


@dataclass(frozen=True)
class CompiledState:
    """``compiled``: training steps run through ``torch.compile`` (not where a measured
    compile chose eager). ``measured``: the measured compile ``optimize`` installed, if any.
    ``cuts_recompile`` and ``description`` are read only when asked: the measured compile
    settles its form on first being asked, after the trainer has said what the run will do."""

    compiled: bool
    measured: MeasuredCompile | None
    wrapped: bool = False
    call: Any = field(default=None, repr=False)  # the compiled call installed in place

    @property
    def cuts_recompile(self) -> bool:
        """Whether a rank cut makes the training steps compile again (static ranks)."""
        return self.compiled and bool(getattr(self.call, "cuts_recompile", True))

    @property
    def description(self) -> str:
        """How the model runs, for ``summary`` (``""`` where nothing is compiled)."""
        if self.wrapped:
            return "wrapped by torch.compile"
        if self.call is None:
            return ""
        describe = getattr(self.call, "describe", None)
        return describe() if describe is not None else "compiled in place (torch.compile)"


def _wrapped(model: nn.Module) -> bool:
    """Whether ``model`` is a ``torch.compile`` wrapper (dynamo loaded: else it cannot be)."""
    dynamo = sys.modules.get("torch._dynamo")
    return dynamo is not None and isinstance(model, dynamo.eval_frame.OptimizedModule)


def compiled_state(model: nn.Module) -> CompiledState:
    """How ``model`` (or the module a ``DistributedDataParallel`` wraps) runs compiled."""
    model = getattr(model, "module", model)
    if _wrapped(model):
        return CompiledState(compiled=True, measured=None, wrapped=True)
    call: Any = getattr(model, "_compiled_call_impl", None)
    if call is None:
        return CompiledState(compiled=False, measured=None)
    return CompiledState(compiled=bool(getattr(call, "compiles_training", True)),
                         measured=call if hasattr(call, "expect_cuts") else None, call=call)
