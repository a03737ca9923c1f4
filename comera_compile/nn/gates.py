"""Rank gates: the diagonal vectors between tensor-train cores that let ranks shrink.

CoMERA places a trainable vector ``d_k`` (initialised to ones) on every internal bond of
a core chain. An entry whose magnitude is at or below ``threshold`` switches its rank
channel off in the forward pass; the rank penalty pushes entries there, and
``prune_ranks`` later removes the dead channels from the cores for real.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn.functional as F
from torch import Tensor

DEFAULT_THRESHOLD = 0.01


def hard_threshold(gate: Tensor, threshold: float) -> Tensor:
    """The gate as the forward sees it: entries with ``|g| <= threshold`` become exactly 0.

    That is ``hardshrink``: one kernel forward and one backward (the gradient is zero
    exactly where the entry is off), where abs / compare / zeros / where took four.
    """
    return F.hardshrink(gate, threshold)


def fold_gates(cores: Sequence[Tensor], gates: Sequence[Tensor], threshold: float) -> list[Tensor]:
    """Scale the right bond of core ``k`` by gate ``k`` so the chain needs no extra operands.

    Folding costs one elementwise product on each (small) core and keeps the contraction
    network the same for every layer kind: only the cores go to the planner. Gates may be
    float32 in a bf16 model; the product takes the core's dtype.
    """
    folded = []
    for k, core in enumerate(cores):
        if k < len(gates):
            core = core * hard_threshold(gates[k], threshold).to(core.dtype)
        folded.append(core)
    return folded


def alive(gate: Tensor, threshold: float) -> Tensor:
    """Boolean mask of the rank channels that are still switched on."""
    return gate.detach().abs() > threshold
