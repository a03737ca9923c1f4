"""The terms CoMERA adds to the task loss (all differentiable in the gates and cores)."""

from __future__ import annotations

from torch import Tensor, nn

from comera_compile.training.bank import GateBank


def rank_penalty(model: nn.Module, weight: float = 0.01, l2_weight: float = 0.0) -> Tensor:
    """``weight * mean(|g|, active g) + l2_weight * sum(core ** 2)`` over tensorized layers."""
    bank = GateBank(model)
    penalty = weight * bank.penalty()
    return penalty + l2_weight * bank.core_l2() if l2_weight else penalty


def core_l2(model: nn.Module) -> Tensor:
    """Sum of squared core entries over all tensorized layers."""
    return GateBank(model).core_l2()


def soft_size(model: nn.Module) -> Tensor:
    """Core parameter count at soft ranks, summed over tensorized layers (differentiable)."""
    return GateBank(model).soft_size()
