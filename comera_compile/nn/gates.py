"""Rank gates: the diagonal vectors between tensor-train cores that let ranks shrink."""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn.functional as F
from torch import Tensor

DEFAULT_THRESHOLD = 0.01


def hard_threshold(gate: Tensor, threshold: float) -> Tensor:
    """The gate as the forward sees it: entries with ``|g| <= threshold`` become exactly 0."""
    return F.hardshrink(gate, threshold)


def fold_gates(cores: Sequence[Tensor], gates: Sequence[Tensor], threshold: float) -> list[Tensor]:
    """Scale the right bond of core ``k`` by gate ``k`` so the chain needs no extra operands."""
    folded = []
    for k, core in enumerate(cores):
        if k < len(gates):
            core = core * hard_threshold(gates[k], threshold).to(core.dtype)
        folded.append(core)
    return folded


def alive(gate: Tensor, threshold: float) -> Tensor:
    """Boolean mask of the rank channels that are still switched on."""
    return gate.detach().abs() > threshold
