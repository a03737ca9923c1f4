"""The terms CoMERA adds to the task loss (all differentiable in the gates and cores).

- ``rank_penalty``: the early-stage l1 on the rank gates, as the reference code has it: the
  mean magnitude of the *active* gate entries (``|g| > threshold``) over all tensorized
  layers, times a small weight. Dead entries get no gradient (the forward already ignores
  them). An optional l2 on the cores stops the cores from growing to undo the shrinking
  gates.
- ``soft_size``: the late stage's size term ``R``. It is the core parameter count with each
  rank replaced by a "soft rank", the sum of ``|g|`` over the bond's active entries. With
  all gates at 1 it equals the true count; it is differentiable in the gates and weights
  each bond by the parameters it costs, so the late stage cuts expensive bonds first.
  The trainer divides it by its value at late-stage start, so ``R`` starts at 1.

What a model weighs (not a loss term) is in ``comera_compile.training.size``.
"""

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
