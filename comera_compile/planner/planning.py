"""Plan one (already bucketed) network: search, cost the tree, optionally autotune."""

from __future__ import annotations

from collections.abc import Sequence

import cotengra
import torch
from torch import Tensor

from .autotune import example_operands, fastest
from .costs import evaluate_path, parse_objective
from .network import BATCH, Network
from .plan import Plan
from .search import search_paths

AUTOTUNE_CANDIDATES = 4


def canonical_path(path: list[tuple[int, int]], num_inputs: int) -> list[tuple[int, int]]:
    """The same tree with each pair ordered by lowest operand (x first): stable, readable
    order expressions and matmul orientation independent of which search ran."""
    low = list(range(num_inputs))
    out = []
    for i, j in path:
        pair = (i, j) if low[i] <= low[j] else (j, i)
        out.append(pair)
        low.append(min(low[i], low[j]))
    return out


def make_plan(
    network: Network,
    path: list[tuple[int, int]],
    objective: str,
    training: bool,
    optimizer: str,
) -> Plan:
    """A :class:`Plan` for ``path`` on ``network`` with its costs evaluated by us."""
    path = canonical_path(path, len(network.inputs))
    cost = evaluate_path(
        network.inputs, network.output, network.size_dict, path, objective, training
    )
    return Plan(
        kind=network.kind,
        equation=network.equation,
        sizes=network.size_dict,
        names=network.names,
        path=list(path),
        macs=cost.macs,
        peak=cost.peak,
        write=cost.write,
        cost=cost.cost,
        objective=objective,
        cotengra_version=cotengra.__version__,
        rows_bucket=network.size_dict.get(BATCH, 1),
        optimizer=optimizer,
        training=training,
    )


def plan_network(
    network: Network,
    *,
    objective: str = "combo",
    training: bool = False,
    autotune: bool = False,
    dtype: torch.dtype = torch.float32,
    device_type: str = "cpu",
    operands_example: Sequence[Tensor] | None = None,
) -> Plan:
    """Search the best tree of ``network`` (no caching; sizes are used as given)."""
    obj = parse_objective(objective)
    k = AUTOTUNE_CANDIDATES if autotune else 1
    paths, optimizer = search_paths(network, obj, training, k)
    plans = [make_plan(network, p, obj.name, training, optimizer) for p in paths]
    if not autotune or len(plans) < 2:
        return plans[0]
    operands = operands_example
    if operands is None:
        operands = example_operands(network, dtype, device_type)
    best = fastest(plans, operands, device_type)
    best.autotuned = True
    return best
