"""Model specs the command line understands: a built-in name or ``package.module:factory``."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from comera_compile.cli.six_encoder import (
    SixEncoderClassifier,
    SixEncoderConfig,
    reference_tensorized,
)


@dataclass
class ModelSpec:
    model: nn.Module
    example_inputs: tuple


def _token_ids(config: SixEncoderConfig, seq: int = 128, batch: int = 32) -> tuple:
    """``(input_ids, token_type_ids)``: both embeddings are then seen in the forward."""
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    return ids, torch.zeros_like(ids)


def _six_encoder(config: SixEncoderConfig, seq: int = 128) -> ModelSpec:
    return ModelSpec(SixEncoderClassifier(config).eval(), _token_ids(config, seq))


def _reference() -> ModelSpec:
    config = SixEncoderConfig()
    return ModelSpec(reference_tensorized(config).eval(), _token_ids(config))


def _mlp() -> ModelSpec:
    model = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                          nn.Linear(1024, 10))
    return ModelSpec(model, (torch.randn(64, 784),))


BUILTIN: dict[str, Callable[[], ModelSpec]] = {
    "six-encoder": lambda: _six_encoder(SixEncoderConfig()),
    "six-encoder-small": lambda: _six_encoder(
        SixEncoderConfig(vocab_size=4096, hidden=256, ffn=1024, heads=4, layers=2), seq=64
    ),
    "six-encoder-reference": _reference,
    "mlp": _mlp,
}


def load_spec(spec: str) -> ModelSpec:
    """Build the model a spec names; the error lists the built-ins and the import form."""
    if spec in BUILTIN:
        return BUILTIN[spec]()
    if ":" not in spec:
        raise ValueError(
            f"unknown model spec {spec!r}: use one of {sorted(BUILTIN)} or "
            "'package.module:factory' (a function returning a model or (model, example_inputs))"
        )
    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"cannot import {spec!r}: {err}") from err
    if not callable(factory):
        raise ValueError(f"{spec!r} is a {type(factory).__name__}, not a function; name a "
                         "factory that returns a model or (model, example_inputs)")
    return _as_spec(spec, factory())


def _as_spec(spec: str, made: object) -> ModelSpec:
    """Check what a factory returned: a module, or a (module, example inputs) pair."""
    inputs: object = ()
    if isinstance(made, tuple | list) and len(made) == 2:
        made, inputs = made
    if not isinstance(made, nn.Module):
        raise ValueError(f"{spec}() returned a {type(made).__name__}, not a torch.nn.Module; "
                         "return a model or (model, example_inputs)")
    return ModelSpec(made, inputs if isinstance(inputs, tuple) else (inputs,))
