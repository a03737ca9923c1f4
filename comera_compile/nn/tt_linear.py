"""TTLinear: a Linear layer whose weight lives as a tensor-train chain (CoMERA's TT format)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from comera_compile.formats import (
    merge_cores,
    tt_linear_fan_ins,
    tt_random_cores,
    tt_svd,
    tt_to_dense,
    zero_pad,
)
from comera_compile.formats.whiten import whitened_tt_svd
from comera_compile.nn.linear_common import ChainLinear
from comera_compile.planner import tt_linear_network


class TTLinear(ChainLinear):
    """``nn.Linear`` replacement in TT format, with rank gates on every internal bond."""

    format = "tt"
    default_ranks = 30
    random_cores = staticmethod(lambda chain, std, dtype, device: tt_random_cores(
        chain.first, chain.second, chain.ranks, std, dtype, device, fan_in_init=True))
    fan_ins = staticmethod(tt_linear_fan_ins)
    network_of = staticmethod(tt_linear_network)

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

    def _decompose(self, weight: Tensor, ranks, tolerance) -> list[Tensor]:
        """TT-SVD of an ``(out, in)`` Linear weight, transposed and zero-padded to the modes."""
        padded = zero_pad(weight.T, self.padded_in, self.padded_out)
        return tt_svd(padded, self.in_modes, self.out_modes, max_rank=ranks, tolerance=tolerance)

    def decompose_whitened(self, weight: Tensor, ranks, gram: Tensor) -> list[Tensor]:
        """Output-aware TT-SVD: the middle bond truncates the whitened weight exactly."""
        padded = zero_pad(weight.T, self.padded_in, self.padded_out)
        return whitened_tt_svd(padded, gram, self.in_modes, self.out_modes, max_rank=ranks)


def merge_right(cores: Sequence[Tensor]) -> Tensor:
    """Chain ``(r_k, n, r) .. (r, n_L, 1)`` into an ``(r_k, n..n_L)`` matrix."""
    acc = cores[-1].reshape(cores[-1].shape[0], -1)
    for core in reversed(cores[:-1]):
        acc = (core.reshape(-1, core.shape[-1]) @ acc).reshape(core.shape[0], -1)
    return acc
