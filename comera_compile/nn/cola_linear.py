"""CoLALinear: a low-rank layer with a nonlinearity on its bond, ``y = silu(x U) diag(g) V``.

CoLA (Liu et al., 2025, "Compute-Efficient Pre-Training of LLMs via Low-Rank Activation",
from CoMERA's group) observed that a pretrained model's activations are low-rank, and that
putting the activation function between the two factors of a low-rank layer lets it match
full-rank pretraining at about half the compute. The factors, gate, pruning and checkpoint
layout are ``LowRankLinear``'s; only the forward differs. Because of the nonlinearity the
layer is no linear map: it has no dense weight and trains from scratch (``init="random"``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from comera_compile.formats import COLA
from comera_compile.nn.base import output_dtype
from comera_compile.nn.gates import hard_threshold
from comera_compile.nn.lowrank_linear import LowRankLinear
from comera_compile.planner.alignment import bond_padding, pad_bond


class CoLALinear(LowRankLinear):
    """``nn.Linear`` replacement ``x -> silu(x U) diag(gate) V + b``, rank-gated on its bond."""

    format = COLA

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"{type(self).__name__} expects inputs of shape (*, {self.in_features}), "
                f"got {tuple(x.shape)}"
            )
        dtype = output_dtype(x)
        # the bond at a rank the CPU's matmuls like (planner.alignment: 30 -> 32): zero
        # columns of U, rows of V and gate entries, and silu(0) * 0 adds nothing, exactly
        u, v = self.cores
        gate = hard_threshold(self.gates[0], self.threshold)
        (extra,) = bond_padding([u, v], x.shape[:-1].numel())
        if extra:
            (u, v), gate = pad_bond(u, v, extra), F.pad(gate, (0, extra))
        u = u.reshape(self.in_features, -1).to(dtype)
        v = v.reshape(-1, self.out_features).to(dtype)
        h = F.silu(x.to(dtype) @ u) * gate.to(dtype)
        y = h @ v
        return y + self.bias.to(dtype) if self.bias is not None else y

    forward_fixed_order = forward

    def to_dense(self) -> Tensor:
        raise NotImplementedError(
            "a CoLA layer applies silu between its factors, so it has no dense weight; "
            "use format='lowrank' where a dense equivalent is needed"
        )

    @classmethod
    def from_dense(cls, module: nn.Linear, ranks=None, tolerance=None, **kwargs):
        raise ValueError(
            "format='cola' has a nonlinearity between its factors and cannot start from a "
            "dense weight: train it from scratch (init='random'), or use format='lowrank' "
            "with init='dense' for a pretrained model"
        )

    @torch.no_grad()
    def output_scale(self) -> float:
        """RMS of ``U V`` (the linear part), which random init matches to the replaced weight."""
        u = self.cores[0].reshape(self.in_features, -1)
        v = self.cores[1].reshape(-1, self.out_features)
        return float((u @ v).square().mean().sqrt())
