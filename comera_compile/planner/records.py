"""Plan records: one row per (layer, batch size) saying which tree runs and what it costs.

``comera_compile.plans(model, ...)`` builds a :class:`PlanReport` from layers; this module
only knows plans. Costs are re-evaluated at the record's own batch size (a plan serves a
whole power-of-two bucket), so ``macs`` is what that batch really pays.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..tables import text_table
from .costs import evaluate_path
from .embedding import CHAIN, EmbeddingPlan, chain_costs, split_costs
from .network import BATCH, Network
from .plan import Plan


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


def plan_records_for(
    name: str,
    network_or_embedding_plan: Network | EmbeddingPlan,
    plan: Plan | EmbeddingPlan,
    dense_macs: int,
    batch_size: int,
) -> PlanRecord:
    """The record of ``plan`` serving layer ``name`` at ``batch_size`` rows."""
    batch_size = int(batch_size)
    source = network_or_embedding_plan
    if isinstance(source, EmbeddingPlan) or isinstance(plan, EmbeddingPlan):
        emb = plan if isinstance(plan, EmbeddingPlan) else source
        macs, peak = _embedding_cost_at(emb, batch_size)
        return PlanRecord(
            name,
            emb.kind,
            batch_size,
            emb.order_expression(),
            macs,
            peak,
            int(dense_macs),
            _ratio(macs, dense_macs),
            emb.equation,
            {**emb.sizes, "b": batch_size},
            emb.path,
            emb.objective,
            macs,
            "comera.split_search",
            emb.rows_bucket,
        )
    network = source.with_sizes(**{BATCH: batch_size}) if source.rows is not None else source
    cost = evaluate_path(
        network.inputs, network.output, network.size_dict, plan.path, plan.objective, plan.training
    )
    return PlanRecord(
        name,
        plan.kind,
        batch_size,
        plan.order_expression(),
        cost.macs,
        cost.peak,
        int(dense_macs),
        _ratio(cost.macs, dense_macs),
        plan.equation,
        network.size_dict,
        list(plan.path),
        plan.objective,
        cost.cost,
        plan.optimizer,
        plan.rows_bucket,
    )


def _embedding_cost_at(emb: EmbeddingPlan, rows: int) -> tuple[int, int]:
    """Macs and peak of ``emb``'s split for exactly ``rows`` ids."""
    if emb.split == 0:
        return 0, max(emb.row_modes[0] * emb.col_modes[0], rows * emb.col_modes[0])
    if emb.split == CHAIN:
        return chain_costs(emb.row_modes, emb.col_modes, emb.ranks, rows)
    total, _, peak = split_costs(emb.row_modes, emb.col_modes, emb.ranks, rows)[emb.split]
    return total, peak


def _ratio(macs: int, dense: int) -> float:
    return macs / dense if dense else float("nan")
