"""Row caches: how much of a recommender table's budget goes to its hot-row cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from comera_compile.nn.row_cache import top_rows
from comera_compile.passes.candidates import Candidate
from comera_compile.passes.specs import LayerSpec

AUTO_SHARE = 0.8
"""Share of a skewed table's parameters that ``row_cache="auto"`` gives its cache. Most of
them: a cached row costs a step what a dense table's row does, a core-built row its rank
times more, so smaller cores make the rows the cache misses cheaper (``benchmarks/dlrm.py``
races the shares)."""

MIN_HIT_RATE = 0.25
"""Held-out hit rate from which a cache pays for the parameters it takes from the cores."""


@dataclass(frozen=True)
class CachePlan:
    """The cache each table gets (``rows``; 0: none) and why."""

    rows: dict[str, int]
    reasons: dict[str, str]

    @property
    def params(self) -> dict[str, int]:
        return {name: rows for name, rows in self.rows.items() if rows}

    def reserve(self, chosen: dict[str, tuple[Candidate, LayerSpec]]) -> int:
        """Parameters the caches take from the budget."""
        return sum(rows * chosen[name][1].out_features for name, rows in self.rows.items())


def held_out_hit_rate(ids: Tensor, capacity: int) -> float:
    """Share of the second half of ``ids`` that a cache of the first half's ``capacity`` most
    frequent ids serves (what a cache chosen from counted ids would hit on new ones)."""
    ids = ids.reshape(-1).long()
    half = ids.numel() // 2
    if half == 0 or capacity <= 0:
        return 0.0
    cached = top_rows(ids[:half], None, capacity)
    return float(torch.isin(ids[half:], cached).float().mean())


def is_recommender_table(module: nn.Module) -> bool:
    """A bag, or a table that asked for sparse gradients (no tied head reads its rows)."""
    return isinstance(module, nn.EmbeddingBag) or bool(getattr(module, "sparse", False))


def plan_caches(chosen: dict[str, tuple[Candidate, LayerSpec]], example_ids: dict[str, Tensor],
                setting: float | str) -> CachePlan:
    """Cache rows for each chosen recommender table, from the parameters the selection gave
    it: ``setting`` "auto" spends ``AUTO_SHARE`` of them where the held-out hit rate of the
    example ids reaches ``MIN_HIT_RATE``; a number spends that share on every such table."""
    rows, reasons = {}, {}
    for name, (cand, spec) in chosen.items():
        if spec.format != "tt_embedding" or not is_recommender_table(cand.module):
            continue
        share = AUTO_SHARE if setting == "auto" else float(setting)
        capacity = min(int(share * spec.params / spec.out_features), spec.in_features)
        if capacity <= 0:
            continue
        if setting != "auto":
            rows[name] = capacity
            reasons[name] = f"is asked for: row_cache={setting!r} of the table's parameters"
            continue
        ids = example_ids.get(name)
        if ids is None:
            reasons[name] = ("no hot-row cache: no example ids to measure the id distribution "
                             "with (pass real ids in example_inputs, or row_cache=<share>)")
            continue
        rate = held_out_hit_rate(ids, capacity)
        if rate < MIN_HIT_RATE:
            reasons[name] = (f"no hot-row cache: ids close to uniform (a {capacity:,}-row cache "
                             f"would serve {rate:.0%} of held-out example lookups, under "
                             f"{MIN_HIT_RATE:.0%})")
            continue
        rows[name] = capacity
        reasons[name] = (f"serves {rate:.0%} of held-out example lookups ({AUTO_SHARE:.0%} of "
                         "the table's parameters)")
    return CachePlan(rows, reasons)
