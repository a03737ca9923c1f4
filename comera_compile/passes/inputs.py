"""Example inputs come as one tensor, a tuple of positional inputs, or a dict of keyword inputs;
every pass calls the model the same way, and every error describes them the same way."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


def as_call(example_inputs: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` for ``model(*args, **kwargs)``."""
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def token_mask(example_inputs: Any) -> torch.Tensor | None:
    """The batch's ``attention_mask`` as booleans where it has a ``(batch, tokens)`` one (a
    Hugging Face batch), else None: padded tokens are not data to fit."""
    mask = example_inputs.get("attention_mask") if isinstance(example_inputs, dict) else None
    return mask.bool() if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None


def real_rows(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``x`` at the mask's real tokens where ``x`` is laid out ``(batch, tokens, ...)`` like
    the mask (token ids, or features with a last dimension); ``x`` itself otherwise."""
    if mask is None or x.dim() < (2 if not x.is_floating_point() else 3):
        return x
    if tuple(x.shape[:2]) != tuple(mask.shape):
        return x
    return x[mask.to(x.device)]


def model_output(output: Any) -> torch.Tensor:
    """A model's main output tensor: a tensor, ``last_hidden_state``, ``logits``, or the
    first item."""
    if isinstance(output, torch.Tensor):
        return output
    for key in ("last_hidden_state", "logits"):
        value = getattr(output, key, None)
        if value is None and isinstance(output, dict):
            value = output.get(key)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"cannot find a tensor to match in a {type(output).__name__}; pass "
                    "output_fn= to pick one")


def _describe_one(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    return type(value).__name__


def describe(args: tuple, kwargs: dict) -> str:
    """``"input 0: (4, 7) float32, attention_mask: (2, 16) int64"``."""
    parts = [f"input {i}: {_describe_one(a)}" for i, a in enumerate(args)]
    parts += [f"{k}: {_describe_one(v)}" for k, v in kwargs.items()]
    return ", ".join(parts) or "no inputs"


@contextlib.contextmanager
def quiet_eval(model: nn.Module) -> Iterator[nn.Module]:
    """Run analysis forwards in eval mode without touching the global RNG."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            yield model
    finally:
        for module, mode in modes:
            module.training = mode
