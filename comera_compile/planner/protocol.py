"""What every layer plan offers, whatever it contracts: one protocol, one split."""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

from torch import Tensor


class RowCost(NamedTuple):
    """What a plan costs for an exact row count (a plan serves a whole power-of-two bucket)."""

    macs: int
    peak: int
    cost: float
    sizes: dict[str, int]


@runtime_checkable
class ForwardPlan(Protocol):
    """How a layer's forward runs for ``rows_bucket`` rows (the decision and its cost), and
    ``execute`` to run it."""

    kind: str
    rows_bucket: int
    objective: str

    @property
    def equation(self) -> str: ...

    @property
    def path(self) -> list[tuple[int, int]]: ...

    @property
    def optimizer(self) -> str: ...

    def order_expression(self) -> str:
        """The tree over operand names, e.g. ``"((x . G1) . G2) . (G3 . G4)"``."""
        ...

    def cost_at(self, rows: int) -> RowCost:
        """Multiply-adds, peak and objective value for exactly ``rows`` rows."""
        ...

    def execute(self, *operands: Tensor) -> Tensor:
        """Run the plan on its operands (the execution side, delegated by each plan)."""
        ...
