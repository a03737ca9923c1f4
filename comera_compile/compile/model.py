"""``compile_model``: torch.compile with the comera backend and the settings it wants."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from comera_compile.compile.options import parse_options


def compile_model(model: nn.Module, dynamic: bool = False, **options: Any) -> nn.Module:
    """``torch.compile(model, backend="comera", dynamic=False, options=options)``.

    Static shapes by default: a plan is only right for its batch-size bucket, so each batch
    size should get its own graph rather than one symbolic graph. Options are checked here,
    before the first call, so a typo fails at once rather than on the first forward.
    """
    parse_options(options)
    return torch.compile(model, backend="comera", dynamic=dynamic, options=options or None)
