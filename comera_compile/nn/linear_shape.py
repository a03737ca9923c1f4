"""What every compressed Linear records of the ``nn.Linear`` it replaces (sizes, modes, a
bias like ``nn.Linear``'s), and the constructor the random-init Linear formats share."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from comera_compile.formats import chain_layout
from comera_compile.nn.gates import DEFAULT_THRESHOLD


class LinearShape:
    """Mixed into a compressed Linear: its dense sizes, its modes and its bias."""

    in_features: int
    out_features: int
    in_modes: tuple[int, ...]
    out_modes: tuple[int, ...]

    @property
    def dense_parameters(self) -> int:
        return self.in_features * self.out_features

    @property
    def dense_fan_in(self) -> int:
        """The fan-in of the dense weight this layer replaces."""
        return self.in_features

    def layout(self) -> dict[str, Any]:
        return {**super().layout(), "in_features": self.in_features,
                "out_features": self.out_features, "in_modes": list(self.in_modes),
                "out_modes": list(self.out_modes), "bias": self.bias is not None}

    def _init_linear(self, in_features: int, out_features: int, in_modes: Sequence[int],
                     out_modes: Sequence[int], bias: bool) -> None:
        """Record the Linear's sizes and modes; a bias like ``nn.Linear``'s, on the cores'
        device and dtype."""
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.in_modes, self.out_modes = tuple(in_modes), tuple(out_modes)
        if not bias:
            self.register_parameter("bias", None)
            return
        core = self.cores[0]
        bound = 1.0 / math.sqrt(self.in_features)  # nn.Linear's default
        self.bias = nn.Parameter(torch.empty(self.out_features, device=core.device,
                                             dtype=core.dtype))
        nn.init.uniform_(self.bias, -bound, bound)


class RandomLinear(LinearShape):
    """The constructor of a Linear format drawn at random: lay the cores out
    (``formats.chain_layout``), draw them (``_random_cores``, the format's own init), then
    the sizes and the bias."""

    format: str
    default_ranks: int = 1

    def __init__(self, in_features: int, out_features: int,
                 ranks: int | Sequence[int] | None = None, in_modes: Sequence[int] | None = None,
                 out_modes: Sequence[int] | None = None, bias: bool = True,
                 order: int | None = None, threshold: float = DEFAULT_THRESHOLD,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        """``ranks``: every internal bond's rank, or one per bond (None: the format's
        ``default_ranks``); ``in_modes`` / ``out_modes`` / ``order``: the layout
        (``formats.chain_layout`` picks what is not given)."""
        ranks = self.default_ranks if ranks is None else ranks
        chain = chain_layout(self.format, in_features, out_features, ranks, in_modes, out_modes,
                             order)
        super().__init__(self._random_cores(chain, in_features, device, dtype), threshold)
        self._init_linear(in_features, out_features, chain.first, chain.second, bias)

    def _random_cores(self, chain: Any, in_features: int, device: Any, dtype: Any) -> list[Tensor]:
        raise NotImplementedError
