"""A contraction plan: the chosen tree of one network for one batch-size bucket."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from .costs import evaluate_path
from .executor import Program, compile_program, run_program
from .network import BATCH
from .protocol import RowCost

FORMAT_VERSION = 2


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"plan cost must be a number, got {value!r}")
    return value


@dataclass(eq=False)
class Plan:
    """How to contract ``equation``: an SSA ``path`` and what it costs."""

    kind: str
    equation: str
    sizes: dict[str, int]
    names: tuple[str, ...]
    path: list[tuple[int, int]]
    macs: int
    peak: int
    write: int
    cost: float
    objective: str
    cotengra_version: str
    rows_bucket: int
    optimizer: str = ""
    training: bool = False
    autotuned: bool = False
    format_version: int = FORMAT_VERSION
    _program: Program | None = field(default=None, init=False, repr=False)

    @property
    def flops(self) -> int:
        """Alias of ``macs`` (cotengra calls multiply-adds flops)."""
        return self.macs

    @property
    def inputs(self) -> tuple[str, ...]:
        return tuple(self.equation.split("->")[0].split(","))

    @property
    def output(self) -> str:
        return self.equation.split("->")[1]

    def order_expression(self) -> str:
        """The tree over operand names, e.g. ``"((x . G1) . G2) . (G3 . G4)"``."""
        exprs: list[str] = list(self.names)
        nested = [False] * len(exprs)
        for i, j in self.path:
            parts = [f"({exprs[p]})" if nested[p] else exprs[p] for p in (i, j)]
            exprs.append(" . ".join(parts))
            nested.append(True)
        return exprs[-1]

    def cost_at(self, rows: int) -> RowCost:
        """The costs re-evaluated with the batch index at exactly ``rows``."""
        sizes = dict(self.sizes)
        if BATCH in sizes:
            sizes[BATCH] = int(rows)
        cost = evaluate_path(
            self.inputs, self.output, sizes, self.path, self.objective, self.training
        )
        return RowCost(cost.macs, cost.peak, cost.cost, sizes)

    def program(self) -> Program:
        if self._program is None:
            self._program = compile_program(self.inputs, self.output, self.path)
        return self._program

    def execute(self, *operands: Tensor, bias: Tensor | None = None) -> Tensor:
        """Contract ``operands`` (network order: x, G1, ...) with plain torch ops."""
        program = self._program
        if program is None:
            program = self.program()
        return run_program(program, operands, bias)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "equation": self.equation,
                "sizes": dict(sorted(self.sizes.items())), "names": list(self.names),
                "path": [list(p) for p in self.path], "macs": self.macs, "peak": self.peak,
                "write": self.write, "cost": self.cost, "objective": self.objective,
                "cotengra_version": self.cotengra_version, "rows_bucket": self.rows_bucket,
                "optimizer": self.optimizer, "training": self.training, "autotuned": self.autotuned,
                "format_version": self.format_version}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """Rebuild a plan from :meth:`to_dict` output (types checked, not the cost)."""
        return cls(kind=str(data["kind"]), equation=str(data["equation"]),
                   sizes={str(k): int(v) for k, v in data["sizes"].items()},
                   names=tuple(str(n) for n in data["names"]),
                   path=[(int(a), int(b)) for a, b in data["path"]], macs=int(data["macs"]),
                   peak=int(data["peak"]), write=int(data["write"]), cost=_number(data["cost"]),
                   objective=str(data["objective"]), cotengra_version=str(data["cotengra_version"]),
                   rows_bucket=int(data["rows_bucket"]), optimizer=str(data.get("optimizer", "")),
                   training=bool(data.get("training", False)),
                   autotuned=bool(data.get("autotuned", False)),
                   format_version=int(data.get("format_version", -1)))
