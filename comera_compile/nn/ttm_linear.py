"""TTMLinear: a Linear layer in tensor-train-matrix form, one core per (out, in) mode pair.

Cores are ``(r_{k-1}, m_k, n_k, r_k)`` with ``m`` the output modes and ``n`` the input
modes of ``nn.Linear.weight`` (``out x in``). Fewer, fatter cores than TT: the chain is
half as long, which suits small batches where sweeping the input through it is cheap.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from comera_compile.formats import (
    fit_ranks,
    positive_int,
    ttm_modes,
    ttm_random_cores,
    ttm_svd,
    ttm_to_dense,
    zero_pad,
)
from comera_compile.nn._checks import modes_cover
from comera_compile.nn.base import TensorizedLayer
from comera_compile.nn.gates import DEFAULT_THRESHOLD
from comera_compile.nn.linear_common import PlannedLinearMixin
from comera_compile.planner import ttm_linear_network


class TTMLinear(PlannedLinearMixin, TensorizedLayer):
    """``nn.Linear`` replacement in TTM format, with rank gates on every internal bond."""

    format = "ttm"

    def __init__(
        self,
        in_features: int,
        out_features: int,
        ranks: int | Sequence[int] = 16,
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
        if order is None and (in_modes is not None or out_modes is not None):
            order = len(in_modes if in_modes is not None else out_modes)
        auto_out, auto_in = ttm_modes(out_features, in_features, order)
        in_modes = modes_cover("in_modes", in_modes or auto_in.modes, in_features)
        out_modes = modes_cover("out_modes", out_modes or auto_out.modes, out_features)
        if len(in_modes) != len(out_modes):
            raise ValueError(
                f"TTM needs as many input as output modes, got {list(in_modes)} and "
                f"{list(out_modes)}; use TTLinear for unequal orders"
            )
        dims = [m * n for m, n in zip(out_modes, in_modes)]
        rank_list = fit_ranks(dims, ranks)
        sigma = 1.0 / math.sqrt(3 * in_features)  # nn.Linear's default weight variance
        cores = ttm_random_cores(out_modes, in_modes, rank_list, sigma, dtype=dtype, device=device)
        super().__init__(cores, threshold)
        self.in_features, self.out_features = in_features, out_features
        self.in_modes, self.out_modes = in_modes, out_modes
        self._init_bias(bias, device, dtype)

    def network_cores(self) -> list[Tensor]:
        """Gated cores with boundary rank-1 axes squeezed, as the planner's network has them."""
        cores = self.gated_cores()
        if len(cores) == 1:
            return [cores[0].reshape(cores[0].shape[1], cores[0].shape[2])]
        cores[0] = cores[0].reshape(cores[0].shape[1:])
        cores[-1] = cores[-1].reshape(cores[-1].shape[:-1])
        return cores

    def _network(self, rows: int):
        return ttm_linear_network(self.in_modes, self.out_modes, self.ranks, rows)

    def forward_fixed_order(self, x: Tensor) -> Tensor:
        """Sweep the input through the cores one at a time (the straightforward order)."""
        x2 = self._pad_input(x.reshape(-1, self.in_features))
        rows = x2.shape[0]
        t = x2.reshape(rows, *self.in_modes, 1)  # trailing rank-1 bond
        for core in self.gated_cores():  # t: (rows, n_k, .., n_d, m_1, .., m_{k-1}, r)
            t = torch.tensordot(t, core, dims=([1, t.dim() - 1], [2, 0]))
        return self._finish(t.reshape(rows, -1), x.shape[:-1])

    def to_dense(self) -> Tensor:
        """The ``(out_features, in_features)`` weight (for export and tests, never a forward)."""
        full = ttm_to_dense(self.gated_cores(), self.out_modes, self.in_modes)
        return full[: self.out_features, : self.in_features]

    @classmethod
    def from_dense(
        cls,
        module: nn.Linear,
        ranks: int | Sequence[int] | None = None,
        tolerance: float | None = None,
        **kwargs,
    ) -> TTMLinear:
        """TTM-SVD of a Linear's weight (full rank when neither ``ranks`` nor ``tolerance``)."""
        layer = cls(
            module.in_features,
            module.out_features,
            ranks=1,
            bias=module.bias is not None,
            device=module.weight.device,
            dtype=module.weight.dtype,
            **kwargs,
        )
        weight = zero_pad(module.weight.detach(), layer.padded_out, layer.padded_in)
        cores = ttm_svd(
            weight, layer.out_modes, layer.in_modes, max_rank=ranks, tolerance=tolerance
        )
        layer._set_cores(cores)
        if module.bias is not None:
            layer.bias.data.copy_(module.bias.detach())
        return layer
