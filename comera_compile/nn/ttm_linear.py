"""TTMLinear: a Linear layer in tensor-train-matrix form, one core per (out, in) mode pair.

Cores are ``(r_{k-1}, m_k, n_k, r_k)`` with ``m`` the output modes and ``n`` the input
modes of ``nn.Linear.weight`` (``out x in``). Fewer, fatter cores than TT: the chain is
half as long, which suits small batches where sweeping the input through it is cheap.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from comera_compile.formats import (
    TTM,
    chain_layout,
    ttm_fan_ins,
    ttm_random_cores,
    ttm_svd,
    ttm_to_dense,
    zero_pad,
)
from comera_compile.formats.whiten import whitened_ttm_svd
from comera_compile.nn.base import TensorizedLayer
from comera_compile.nn.gates import DEFAULT_THRESHOLD
from comera_compile.nn.linear_common import PlannedLinearMixin, linear_init_std
from comera_compile.planner import ttm_linear_network


class TTMLinear(PlannedLinearMixin, TensorizedLayer):
    """``nn.Linear`` replacement in TTM format, with rank gates on every internal bond."""

    format = TTM

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
        chain = chain_layout(TTM, in_features, out_features, ranks, in_modes, out_modes, order)
        std = linear_init_std(in_features)
        cores = ttm_random_cores(chain.second, chain.first, chain.ranks, std, dtype, device,
                                 fan_in_init=True)
        super().__init__(cores, threshold)
        self._init_linear(in_features, out_features, chain.first, chain.second, bias)

    def core_fan_ins(self) -> list[int]:
        """Entries of the incoming activation each core sums over (``formats.scaling``)."""
        return ttm_fan_ins(self.in_modes, self.ranks)

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

    def _decompose(self, weight: Tensor, ranks, tolerance) -> list[Tensor]:
        """TTM-SVD of an ``(out, in)`` Linear weight, zero-padded to the modes."""
        padded = zero_pad(weight, self.padded_out, self.padded_in)
        return ttm_svd(padded, self.out_modes, self.in_modes, max_rank=ranks, tolerance=tolerance)

    def decompose_whitened(self, weight: Tensor, ranks, gram: Tensor) -> list[Tensor]:
        """Output-aware TTM-SVD in the Kronecker-whitened metric of ``gram``."""
        padded = zero_pad(weight, self.padded_out, self.padded_in)
        return whitened_ttm_svd(padded, gram, self.out_modes, self.in_modes, max_rank=ranks)
