"""Targets: which layers the user asked for, PEFT-style."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

CONFIG_KEYS = ("format", "ranks", "in_modes", "out_modes", "row_modes", "col_modes", "order",
               "blocks")

Names = str | Sequence[str] | None


def matches_names(name: str, names: Names) -> bool:
    """PEFT's rule: a string is a regex for the whole name; a list holds names or suffixes,
    and globs (an entry with ``*``, ``?`` or ``[``: ``"bottom.*"``) for the whole name."""
    if names is None:
        return False
    if isinstance(names, str):
        return re.fullmatch(names, name) is not None
    return any(name == n or name.endswith("." + n) or (
        any(c in n for c in "*?[") and fnmatch.fnmatchcase(name, n)) for n in names)


def matches_pattern(name: str, pattern: str) -> bool:
    """A glob (``"encoder.*.ffn.*"``) or a regex (``r"layers\\.\\d+\\.ffn\\..*"``)."""
    if fnmatch.fnmatchcase(name, pattern):
        return True
    try:
        return re.fullmatch(pattern, name) is not None
    except re.error:
        return False


def check_layer_config(layer_config: dict[str, dict[str, Any]] | None) -> dict[str, dict]:
    """Refuse unknown settings now, before any work, naming the accepted ones."""
    layer_config = dict(layer_config or {})
    for pattern, settings in layer_config.items():
        if not isinstance(settings, dict):
            raise ValueError(f"layer_config[{pattern!r}] must be a dict of settings, got "
                             f"{type(settings).__name__}")
        unknown = sorted(set(settings) - set(CONFIG_KEYS))
        if unknown:
            raise ValueError(f"layer_config[{pattern!r}] has unknown settings {unknown}; "
                             f"accepted: {list(CONFIG_KEYS)}")
    return layer_config


def config_for(name: str, layer_config: dict[str, dict]) -> dict[str, Any] | None:
    """Settings of every pattern that matches, merged in order; None if none matches."""
    merged: dict[str, Any] | None = None
    for pattern, settings in layer_config.items():
        if matches_pattern(name, pattern):
            merged = {**(merged or {}), **settings}
    return merged


def user_skip(name: str, module: nn.Module, include: Names, exclude: Names,
              filter_fn: Callable[[nn.Module, str], bool] | None, configured: bool) -> str | None:
    """Why the user's choices keep this layer dense, or None."""
    if matches_names(name, exclude):
        return "excluded by exclude="
    if configured:
        return None
    if include is not None and not matches_names(name, include):
        return "not matched by include="
    if filter_fn is not None and not filter_fn(module, name):
        return "filter_fn returned False"
    return None
