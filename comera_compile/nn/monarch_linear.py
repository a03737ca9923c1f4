"""MonarchLinear: a Linear layer whose weight is a Monarch matrix (two block-diagonal
factors and a fixed permutation, ``formats.monarch``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from comera_compile.formats import (
    MONARCH,
    monarch_core_shapes,
    monarch_fan_ins,
    monarch_init_stds,
    monarch_modes,
    monarch_multiply,
    monarch_params,
    monarch_project,
    monarch_to_dense,
    zero_pad,
)
from comera_compile.nn.base import PruneResult
from comera_compile.nn.block_linear import BlockLinear


class MonarchLinear(BlockLinear):
    """``nn.Linear`` replacement ``x -> x M + b`` with ``M`` a Monarch matrix of ``blocks``
    blocks (``in_modes = (blocks, block inputs)``, ``out_modes = (blocks, block outputs)``
    say the same; ``ranks`` is accepted for a uniform signature and ignored)."""

    format = MONARCH

    def __init__(self, in_features: int, out_features: int, ranks: Any = None,
                 in_modes: Sequence[int] | None = None, out_modes: Sequence[int] | None = None,
                 *args: Any, blocks: int | None = None, **kwargs: Any) -> None:
        """``RandomLinear``'s arguments (``ranks`` ignored), or ``blocks`` for the modes."""
        if blocks is not None:
            if in_modes is not None or out_modes is not None:
                raise ValueError("give blocks or in_modes/out_modes, not both")
            in_modes, out_modes = monarch_modes(in_features, out_features, blocks)
        super().__init__(in_features, out_features, 1, in_modes, out_modes, *args, **kwargs)
        self.gates = nn.ParameterList()  # no rank bond, so no gate

    def _random_cores(self, chain: Any, in_features: int, device: Any, dtype: Any) -> list[Tensor]:
        shapes = monarch_core_shapes(chain.first, chain.second)
        stds = monarch_init_stds(chain.first, chain.second)
        return [torch.randn(shape, device=device, dtype=dtype) * std
                for shape, std in zip(shapes, stds)]

    @property
    def blocks(self) -> int:
        return self.in_modes[0]

    # ----- no rank: the chain machinery sees a layer without bonds ------------------------
    @property
    def ranks(self) -> list[int]:
        """``[1, 1]``: Monarch has no rank bond (its size is the block count)."""
        return [1, 1]

    def core_shape(self, k: int, ranks: list[int]) -> tuple[int, ...]:
        return tuple(int(s) for s in self.cores[k].shape)

    @torch.no_grad()
    def prune_ranks(self, multiple_of: int | None = None) -> PruneResult:
        """Nothing to prune: Monarch has no rank bond."""
        count = self.num_core_parameters()
        return PruneResult([], count, count)

    def _adopt_layout(self, saved: dict) -> None:
        super()._adopt_layout({**saved, "ranks": self.ranks})

    def core_fan_ins(self) -> list[int]:
        """Entries each factor's blocks sum over: ``p`` and ``q`` (``formats.monarch``)."""
        return monarch_fan_ins(self.in_modes, self.out_modes)

    def macs_per_row(self) -> int:
        return monarch_params(self.in_modes, self.out_modes)

    def hidden_width(self) -> int:
        return self.blocks * self.cores[0].shape[-1]

    def _multiply(self, x2: Tensor, dtype: torch.dtype) -> Tensor:
        return monarch_multiply(x2, self.cores[0].to(dtype), self.cores[1].to(dtype))

    def _dense_padded(self) -> Tensor:
        return monarch_to_dense(self.cores[0], self.cores[1])

    @classmethod
    def from_dense(cls, module: nn.Linear, ranks: int | Sequence[int] | None = None,
                   tolerance: float | None = None, gram: Tensor | None = None,
                   **kwargs) -> MonarchLinear:
        """The Monarch matrix closest to ``module``'s weight (Dao et al.'s projection: each
        block's truncated SVD). ``ranks``, ``tolerance`` and ``gram`` do not apply: the block
        count (``blocks=`` or the modes) sets the size."""
        if tolerance is not None:
            raise ValueError("a Monarch layer's size is its block count, not an error "
                             "tolerance; pass blocks=... (or use format='btt' with tolerance)")
        layer = cls(module.in_features, module.out_features, bias=module.bias is not None,
                    device=module.weight.device, dtype=module.weight.dtype, **kwargs)
        (b, p), (_, s) = layer.in_modes, layer.out_modes
        weight = zero_pad(module.weight.detach().T, b * p, b * s)
        layer._set_cores(monarch_project(weight, layer.in_modes, layer.out_modes))
        if module.bias is not None:
            layer.bias.data.copy_(module.bias.detach())
        return layer
