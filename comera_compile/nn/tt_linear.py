"""TTLinear: a Linear layer whose weight lives as a tensor-train chain (CoMERA's TT format).

``W`` (``N_in x N_out``, i.e. ``nn.Linear.weight.T``) is a chain of cores over the input
modes then the output modes. The forward is a contraction of the input with the gated
cores in the order the planner chose for this batch size; the dense weight is never built.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from comera_compile.formats import (
    fit_ranks,
    merge_cores,
    positive_int,
    tt_linear_modes,
    tt_random_cores,
    tt_svd,
    tt_to_dense,
    zero_pad,
)
from comera_compile.nn._checks import modes_cover
from comera_compile.nn.base import TensorizedLayer
from comera_compile.nn.gates import DEFAULT_THRESHOLD
from comera_compile.nn.linear_common import PlannedLinearMixin
from comera_compile.planner import tt_linear_network


class TTLinear(PlannedLinearMixin, TensorizedLayer):
    """``nn.Linear`` replacement in TT format, with rank gates on every internal bond."""

    format = "tt"

    def __init__(
        self,
        in_features: int,
        out_features: int,
        ranks: int | Sequence[int] = 30,
        in_modes: Sequence[int] | None = None,
        out_modes: Sequence[int] | None = None,
        bias: bool = True,
        order: int | None = None,
        threshold: float = DEFAULT_THRESHOLD,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        in_features = positive_int("in_features", in_features)
        out_features = positive_int("out_features", out_features)
        auto_in, auto_out = tt_linear_modes(in_features, out_features, order)
        in_modes = modes_cover("in_modes", in_modes or auto_in.modes, in_features)
        out_modes = modes_cover("out_modes", out_modes or auto_out.modes, out_features)
        rank_list = fit_ranks(in_modes + out_modes, ranks)
        # nn.Linear's default weight variance is 1 / (3 in_features); match it.
        sigma = 1.0 / math.sqrt(3 * in_features)
        cores = tt_random_cores(in_modes, out_modes, rank_list, sigma, dtype=dtype, device=device)
        super().__init__(cores, threshold)
        self.in_features, self.out_features = in_features, out_features
        self.in_modes, self.out_modes = in_modes, out_modes
        self._init_bias(bias, device, dtype)

    # ----- the contraction ----------------------------------------------------------------
    def network_cores(self) -> list[Tensor]:
        """Gated cores with the boundary rank-1 axes squeezed, as the planner's network has them."""
        cores = self.gated_cores()
        first, last = cores[0], cores[-1]
        cores[0] = first.reshape(first.shape[1], first.shape[2])
        cores[-1] = last.reshape(last.shape[0], last.shape[1])
        return cores

    def _network(self, rows: int):
        return tt_linear_network(self.in_modes, self.out_modes, self.ranks, rows)

    def forward_fixed_order(self, x: Tensor) -> Tensor:
        """CoMERA's fixed order (merge input cores, merge output cores, two matmuls); kept as
        the baseline the planner is measured against."""
        d = len(self.in_modes)
        cores = self.gated_cores()
        left, right = merge_cores(cores[:d]), merge_right(cores[d:])
        x2 = self._pad_input(x.reshape(-1, self.in_features))
        y = (x2 @ left) @ right
        return self._finish(y, x.shape[:-1])

    def to_dense(self) -> Tensor:
        """The ``(out_features, in_features)`` weight (for export and tests, never a forward)."""
        full = tt_to_dense(self.gated_cores(), self.in_modes, self.out_modes)
        return full[: self.in_features, : self.out_features].T

    @classmethod
    def from_dense(
        cls,
        module: nn.Linear,
        ranks: int | Sequence[int] | None = None,
        tolerance: float | None = None,
        **kwargs,
    ) -> TTLinear:
        """TT-SVD of a Linear's weight (full rank when neither ``ranks`` nor ``tolerance``)."""
        layer = cls(
            module.in_features,
            module.out_features,
            ranks=1,
            bias=module.bias is not None,
            device=module.weight.device,
            dtype=module.weight.dtype,
            **kwargs,
        )
        weight = zero_pad(module.weight.detach().T, layer.padded_in, layer.padded_out)
        cores = tt_svd(weight, layer.in_modes, layer.out_modes, max_rank=ranks, tolerance=tolerance)
        layer._set_cores(cores)
        if module.bias is not None:
            layer.bias.data.copy_(module.bias.detach())
        return layer


def merge_right(cores: Sequence[Tensor]) -> Tensor:
    """Chain ``(r_k, n, r) .. (r, n_L, 1)`` into an ``(r_k, n..n_L)`` matrix."""
    acc = cores[-1].reshape(cores[-1].shape[0], -1)
    for core in reversed(cores[:-1]):
        acc = (core.reshape(-1, core.shape[-1]) @ acc).reshape(core.shape[0], -1)
    return acc
