"""TTMLinear: a Linear layer in tensor-train-matrix form, one core per (out, in) mode pair."""

from __future__ import annotations

import torch
from torch import Tensor

from comera_compile.formats import (
    TTM,
    ttm_fan_ins,
    ttm_random_cores,
    ttm_svd,
    ttm_to_dense,
    zero_pad,
)
from comera_compile.formats.whiten import whitened_ttm_svd
from comera_compile.nn.linear_common import ChainLinear
from comera_compile.planner import ttm_linear_network


class TTMLinear(ChainLinear):
    """``nn.Linear`` replacement in TTM format, with rank gates on every internal bond."""

    format = TTM
    default_ranks = 16
    random_cores = staticmethod(lambda chain, std, dtype, device: ttm_random_cores(
        chain.second, chain.first, chain.ranks, std, dtype, device, fan_in_init=True))
    fan_ins = staticmethod(ttm_fan_ins)
    network_of = staticmethod(ttm_linear_network)

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

    def _decompose(self, weight: Tensor, ranks, tolerance) -> list[Tensor]:
        """TTM-SVD of an ``(out, in)`` Linear weight, zero-padded to the modes."""
        padded = zero_pad(weight, self.padded_out, self.padded_in)
        return ttm_svd(padded, self.out_modes, self.in_modes, max_rank=ranks, tolerance=tolerance)

    def decompose_whitened(self, weight: Tensor, ranks, gram: Tensor) -> list[Tensor]:
        """Output-aware TTM-SVD in the Kronecker-whitened metric of ``gram``."""
        padded = zero_pad(weight, self.padded_out, self.padded_in)
        return whitened_ttm_svd(padded, gram, self.out_modes, self.in_modes, max_rank=ranks)
