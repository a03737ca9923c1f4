"""LowRankLinear: the plain low-rank factorization ``W = U V`` as a TT with one mode per side.

A TT-linear chain of order 1 has two cores, ``U`` (``in_features x r``) and ``V``
(``r x out_features``), and one rank bond between them: exactly the LoRA / CoLA low-rank
layer. Expressing it through the TT machinery gives it the same rank gate, pruning,
planner, checkpoints and compile path as every other layer. It is the fastest format per
input row (two thin matmuls) but loses accuracy first at high compression.
"""

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
