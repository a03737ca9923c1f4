"""Materialize: give a model built on the meta device real storage, after the rewrite."""

from __future__ import annotations

import torch
from torch import nn


def on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def _owns_meta(module: nn.Module) -> bool:
    return any(t is not None and t.is_meta
               for t in (*module._parameters.values(), *module._buffers.values()))


def materialize(model: nn.Module, device: torch.device | str) -> int:
    """Allocate and initialise every tensor still on meta; returns how many modules."""
    init_hf = getattr(model, "_init_weights", None)
    done = 0
    uninitialised = []
    for name, module in model.named_modules():
        if not _owns_meta(module):
            continue
        module.to_empty(device=device, recurse=False)
        if callable(init_hf):
            init_hf(module)
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()
        else:
            uninitialised.append(name or type(model).__name__)
        done += 1
    if uninitialised:
        raise ValueError(
            f"modules {uninitialised} were built on the meta device and have no "
            "reset_parameters() to initialise them; build them on a real device, or give "
            "them reset_parameters()"
        )
    return done
