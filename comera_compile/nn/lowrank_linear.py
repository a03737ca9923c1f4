"""LowRankLinear: the plain low-rank factorization ``W = U V`` as a TT with one mode per side.

A TT-linear chain of order 1 has two cores, ``U`` (``in_features x r``) and ``V``
(``r x out_features``), and one rank bond between them: exactly the LoRA / CoLA low-rank
layer. Expressing it through the TT machinery gives it the same rank gate, pruning,
planner, checkpoints and compile path as every other layer. It is the fastest format per
input row (two thin matmuls) but loses accuracy first at high compression.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from comera_compile.nn.gates import DEFAULT_THRESHOLD
from comera_compile.nn.tt_linear import TTLinear


class LowRankLinear(TTLinear):
    """``nn.Linear`` replacement ``x -> x U diag(gate) V + b`` with a rank gate on the bond."""

    format = "lowrank"

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
        if order not in (None, 1):
            raise ValueError(
                f"a low-rank layer has one mode per side (order 1), got order={order!r}; "
                "use TTLinear (format='tt') for higher orders"
            )
        for name, modes in (("in_modes", in_modes), ("out_modes", out_modes)):
            if modes is not None and len(modes) != 1:
                raise ValueError(
                    f"a low-rank layer has one mode per side, got {name}={list(modes)}; "
                    "leave it as None or use TTLinear (format='tt') for several modes"
                )
        super().__init__(
            in_features, out_features, ranks=ranks, in_modes=in_modes, out_modes=out_modes,
            bias=bias, order=1, threshold=threshold, device=device, dtype=dtype,
        )

    @property
    def rank(self) -> int:
        """The stored rank of ``W = U V`` (the one internal bond)."""
        return self.ranks[1]
