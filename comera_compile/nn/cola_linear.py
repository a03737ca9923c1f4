"""CoLALinear: a low-rank layer with a nonlinearity on its bond, ``y = silu(x U) diag(g) V``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from comera_compile.formats import COLA
from comera_compile.nn.base import output_dtype
from comera_compile.nn.gates import hard_threshold
from comera_compile.nn.lowrank_linear import LowRankLinear
from comera_compile.planner.alignment import bond_padding, pad_bond


@torch.library.custom_op("comera::bond_product", mutates_args=())
def bond_product(x: Tensor, u: Tensor) -> Tensor:
    """``x @ u`` for a 2-d ``x`` and the rank-wide factor ``u``: the bond of a CoLA layer, as
    an op of its own so that a checkpoint policy can name it (``compile.bond_recompute``)."""
    return x @ u


@bond_product.register_fake
def _(x: Tensor, u: Tensor) -> Tensor:
    return x.new_empty((x.shape[0], u.shape[1]))


def _bond_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _bond_backward(ctx, grad: Tensor):
    x, u = ctx.saved_tensors
    return grad @ u.mT, x.mT @ grad


bond_product.register_autograd(_bond_backward, setup_context=_bond_setup)


class _CoLAProduct(torch.autograd.Function):
    """``silu(x U) diag(gate) V`` for a 2-d ``x``, keeping ``x`` and ``z = x U`` for backward
    (module docstring); the factors and the gate are parameters, kept anyway."""

    @staticmethod
    def forward(ctx, x: Tensor, u: Tensor, gate: Tensor, v: Tensor, named: bool) -> Tensor:
        z = bond_product(x, u) if named else x @ u  # the op costs a Python dispatch: on demand
        ctx.save_for_backward(x, z, u, gate, v)
        return (F.silu(z) * gate) @ v

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: Tensor):
        x, z, u, gate, v = ctx.saved_tensors
        need_x, need_u, need_gate, need_v, _ = ctx.needs_input_grad
        s = F.silu(z)
        dv = (s * gate).mT @ dy if need_v else None
        dh = dy @ v.mT
        dgate = (dh * s).sum(0) if need_gate else None
        dz = torch.ops.aten.silu_backward(dh * gate, z)
        du = x.mT @ dz if need_u else None
        dx = dz @ u.mT if need_x else None
        return dx, du, dgate, dv, None


class CoLALinear(LowRankLinear):
    """``nn.Linear`` replacement ``x -> silu(x U) diag(gate) V + b``, rank-gated on its bond."""

    format = COLA
    keeps_bond = False
    """Set by ``compile.bond_recompute`` on the layers of a recomputed block: the bond is then
    computed as :func:`bond_product`, which the checkpoint policy keeps (otherwise a plain
    matmul: no custom op's dispatch eager, and compiled graphs keep plain matmuls, which the
    compiler's own passes join and orient)."""

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
        x, gate = x.to(dtype), gate.to(dtype)
        if torch.compiler.is_compiling():  # the compiler picks what to keep for backward
            z = bond_product(x.reshape(-1, self.in_features), u).reshape(
                *x.shape[:-1], -1) if self.keeps_bond else x @ u
            y = (F.silu(z) * gate) @ v
        else:
            rows = x.reshape(-1, self.in_features)
            y = _CoLAProduct.apply(rows, u, gate, v, self.keeps_bond).reshape(
                *x.shape[:-1], self.out_features)
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
