"""LowRankLinear: the plain low-rank factorization ``W = U V`` as a TT with one mode per side."""

from __future__ import annotations

from comera_compile.formats import LOWRANK
from comera_compile.nn.tt_linear import TTLinear


class LowRankLinear(TTLinear):
    """``nn.Linear`` replacement ``x -> x U diag(gate) V + b`` with a rank gate on the bond."""

    format = LOWRANK  # TTLinear's constructor lays the chain out at order 1 for this format

    @property
    def rank(self) -> int:
        """The stored rank of ``W = U V`` (the one internal bond)."""
        return self.ranks[1]
