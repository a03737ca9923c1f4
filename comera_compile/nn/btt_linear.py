"""BTTLinear: a Linear layer whose weight is a Block Tensor-Train of two cores."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from comera_compile.formats import (
    BTT,
    btt_fan_ins,
    btt_init_stds,
    btt_multiply,
    btt_params,
    btt_project,
    btt_rank_cap,
    btt_to_dense,
    chain_layout,
    zero_pad,
)
from comera_compile.formats.btt import btt_core_shapes
from comera_compile.nn.block_linear import BlockLinear
from comera_compile.nn.gates import hard_threshold


class BTTLinear(BlockLinear):
    """``nn.Linear`` replacement ``x -> x W + b`` with ``W`` a rank-``r`` BTT, rank-gated.

    ``ranks``: the BTT rank (an int, clipped to ``min(m0, n1)``, where BTT holds every
    matrix; or ``[1, r, 1]``). ``in_modes = (m1, m0)`` and ``out_modes = (n0, n1)`` default
    to each size's most even two factors (padded where it factors badly).
    """

    format = BTT

    def _random_cores(self, chain: Any, in_features: int, device: Any, dtype: Any) -> list[Tensor]:
        rank = chain.ranks[1]
        stds = btt_init_stds(chain.first, chain.second, rank)
        shapes = btt_core_shapes(chain.first, chain.second, rank)
        return [torch.randn(shape, device=device, dtype=dtype) * std
                for shape, std in zip(shapes, stds)]

    @property
    def rank(self) -> int:
        """The stored rank of the bond between the two cores."""
        return self.ranks[1]

    def core_fan_ins(self) -> list[int]:
        """Entries each core's blocks sum over: ``m0`` and ``m1 r`` (``formats.btt``)."""
        return btt_fan_ins(self.in_modes, self.rank)

    def macs_per_row(self) -> int:
        return btt_params(self.in_modes, self.out_modes, self.rank)

    def hidden_width(self) -> int:
        return self.in_modes[0] * self.out_modes[0] * self.rank

    def _multiply(self, x2: Tensor, dtype: torch.dtype) -> Tensor:
        gate = hard_threshold(self.gates[0], self.threshold).to(dtype)
        a = self.cores[0].to(dtype) * gate  # the gate folded into the bond of the first core
        return btt_multiply(x2, a, self.cores[1].to(dtype))

    def _dense_padded(self) -> Tensor:
        a, b = self.gated_cores()
        return btt_to_dense(a, b)

    @torch.no_grad()
    def frobenius_norm(self) -> float:
        """``||W||`` from each block's two small Grams, without building ``W``."""
        a, b = self.gated_cores()
        _, m1, m0, n0, r = a.shape
        left = a.reshape(m1, m0, n0, r).permute(0, 2, 1, 3).float()  # (m1, n0, m0, r)
        right = b.reshape(r, n0, m1, b.shape[3]).permute(2, 1, 0, 3).float()  # (m1, n0, r, n1)
        gram_left = left.transpose(-1, -2) @ left
        gram_right = right @ right.transpose(-1, -2)
        return float((gram_left * gram_right).sum().clamp_min(0).sqrt())

    @classmethod
    def from_dense(cls, module: nn.Linear, ranks: int | Sequence[int] | None = None,
                   tolerance: float | None = None, gram: Tensor | None = None,
                   **kwargs) -> BTTLinear:
        """The BTT closest to ``module``'s weight at ``ranks`` (per-block truncated SVD;
        exact at the default, the rank that holds every matrix), or the least rank within
        the relative error ``tolerance``. ``gram`` (an input Gram) is not used: the
        projection minimises the weight's error."""
        layer = cls(module.in_features, module.out_features, ranks=1,
                    bias=module.bias is not None, device=module.weight.device,
                    dtype=module.weight.dtype, **kwargs)
        cap = btt_rank_cap(layer.in_modes, layer.out_modes)
        weight = zero_pad(module.weight.detach().T, *layer._padded_sizes())
        if ranks is None:
            rank = cap if tolerance is None else layer._rank_within(weight, tolerance)
        else:
            rank = chain_layout(BTT, layer.in_features, layer.out_features, ranks,
                                layer.in_modes, layer.out_modes).ranks[1]
        layer._set_cores(btt_project(weight, layer.in_modes, layer.out_modes, rank))
        if module.bias is not None:
            layer.bias.data.copy_(module.bias.detach())
        return layer

    def _padded_sizes(self) -> tuple[int, int]:
        return (self.in_modes[0] * self.in_modes[1], self.out_modes[0] * self.out_modes[1])

    def _rank_within(self, weight: Tensor, tolerance: float) -> int:
        """The least rank whose per-block truncation leaves a relative error <= tolerance."""
        (m1, m0), (n0, n1) = self.in_modes, self.out_modes
        blocks = weight.reshape(m1, m0, n0, n1).permute(0, 2, 1, 3).float()
        energy = torch.linalg.svdvals(blocks).square()  # (m1, n0, min(m0, n1))
        total = float(energy.sum())
        for rank in range(1, energy.shape[-1] + 1):
            if float(energy[..., rank:].sum()) <= tolerance ** 2 * total:
                return rank
        return energy.shape[-1]
