"""The ``comera`` torch.compile backend, the compiled-model wrapper and whole-step CUDA
Graph capture of training. The names load on first use: importing this package does not
import inductor."""

from __future__ import annotations

import importlib
from typing import Any

from comera_compile.compile.state import CompiledState, compiled_state

_LAZY = {"comera_backend": "comera_compile.compile.backend",
         "graphs_compiled": "comera_compile.compile.backend",
         "tensorized_nodes": "comera_compile.compile.backend",
         "compile_model": "comera_compile.compile.model",
         "TrainStep": "comera_compile.compile.train_step",
         "capture_train_step": "comera_compile.compile.train_step",
         "traced_plans": "comera_compile.planner.ops"}

__all__ = ["CompiledState", "compiled_state", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
