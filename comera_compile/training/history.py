"""Per-step record of rank-adaptive training: losses, stage, ranks, size, compression."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any


class History:
    """A list of step records with column access and CSV export."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def record(self, **row: Any) -> None:
        self.records.append(row)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.records[i]

    def column(self, name: str) -> list[Any]:
        """Values of one field over all steps (``None`` where a step did not record it)."""
        return [r.get(name) for r in self.records]

    def layer_names(self) -> list[str]:
        return list(self.records[0]["ranks"]) if self.records else []

    def rank_columns(self) -> dict[str, list[list[int]]]:
        """Layer name -> effective rank lists, one per step."""
        return {name: [r["ranks"][name] for r in self.records] for name in self.layer_names()}

    def to_csv(self, path: str | Path) -> Path:
        """Write one row per step; each internal bond gets a column ``rank:<layer>:<k>``."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        scalar = [k for k in self.records[0] if k != "ranks"] if self.records else []
        bonds = [(name, k)
                 for name in self.layer_names()
                 for k in range(1, len(self.records[0]["ranks"][name]) - 1)]
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(scalar + [f"rank:{name}:{k}" for name, k in bonds])
            for r in self.records:
                writer.writerow([r.get(k) for k in scalar] + [r["ranks"][n][k] for n, k in bonds])
        return path

    def state_dict(self) -> dict[str, Any]:
        return {"records": [dict(r) for r in self.records]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.records = [dict(r) for r in state["records"]]
