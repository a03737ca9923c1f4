"""Plan records: one row per (layer, batch size) saying which tree runs and what it costs."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..tables import text_table
from .protocol import ForwardPlan


@dataclass
class PlanRecord:
    """What one layer does at one batch size."""

    layer: str
    kind: str
    batch_size: int
    order: str
    macs: int
    peak: int
    dense_macs: int
    ratio: float  # macs / dense_macs (below 1 means fewer multiply-adds than dense)
    equation: str
    sizes: dict[str, int]
    path: list[tuple[int, int]]
    objective: str
    cost: float
    optimizer: str = ""
    rows_bucket: int = 0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["path"] = [list(p) for p in self.path]
        return out


@dataclass
class PlanReport:
    """A list of :class:`PlanRecord` with a JSON dump and an aligned text table."""

    records: list[PlanRecord] = field(default_factory=list)

    def __iter__(self):
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, item: int) -> PlanRecord:
        return self.records[item]

    def append(self, record: PlanRecord) -> None:
        self.records.append(record)

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps([r.to_dict() for r in self.records], indent=2)
        if path is not None:
            Path(path).write_text(text)
        return text

    def __str__(self) -> str:
        header = ("layer", "kind", "batch", "macs", "dense", "ratio", "peak", "order")
        rows = [
            (
                r.layer,
                r.kind,
                str(r.batch_size),
                f"{r.macs:,}",
                f"{r.dense_macs:,}",
                f"{r.ratio:.3f}",
                f"{r.peak:,}",
                r.order,
            )
            for r in self.records
        ]
        return text_table(header, rows, right={2, 3, 4, 5, 6})


def record_plan(name: str, plan: ForwardPlan, dense_macs: int, batch_size: int) -> PlanRecord:
    """The record of ``plan`` serving layer ``name`` at exactly ``batch_size`` rows."""
    batch_size = int(batch_size)
    at = plan.cost_at(batch_size)
    return PlanRecord(name, plan.kind, batch_size, plan.order_expression(), at.macs, at.peak,
                      int(dense_macs), at.macs / dense_macs if dense_macs else float("nan"),
                      plan.equation, at.sizes, list(plan.path), plan.objective, at.cost,
                      plan.optimizer, plan.rows_bucket)
