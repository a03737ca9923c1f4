"""Plan one (already bucketed) network: search, cost the tree, optionally autotune."""

from __future__ import annotations

import math
from collections.abc import Sequence

import cotengra
import torch
from torch import Tensor

from .autotune import example_operands, fastest
from .costs import evaluate_path, parse_objective
from .network import BATCH, Network
from .networks import tt_linear_reference_path
from .plan import Plan
from .search import search_paths

AUTOTUNE_CANDIDATES = 4


def dense_weight_size(network: Network) -> int | None:
    """Elements of the dense matrix a layer network stands for (input modes x output
    modes), or None for a network without a batch-carrying input."""
    if not network.inputs or BATCH not in network.inputs[0]:
        return None
    sizes = network.size_dict
    modes = (network.inputs[0] + network.output).replace(BATCH, "")
    return math.prod(sizes[ix] for ix in modes)


def largest_weight_intermediate(network: Network, path: Sequence[Sequence[int]]) -> int:
    """Largest intermediate made of cores alone (no operand 0) along ``path``."""
    count: dict[str, int] = {}
    for term in (*network.inputs, network.output):
        for ix in term:
            count[ix] = count.get(ix, 0) + 1
    terms = {k: (set(t), k == 0) for k, t in enumerate(network.inputs)}
    sizes, largest, nxt = network.size_dict, 0, len(network.inputs)
    for i, j in path:
        (a, a_x), (b, b_x) = terms.pop(i), terms.pop(j)
        for ix in (*a, *b):
            count[ix] -= 1
        result = {ix for ix in a | b if count[ix] > 0}
        for ix in result:
            count[ix] += 1
        if not (a_x or b_x):
            largest = max(largest, math.prod(sizes[ix] for ix in result))
        terms[nxt] = (result, a_x or b_x)
        nxt += 1
    return largest


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


def make_plan(network: Network, path: list[tuple[int, int]], objective: str, training: bool,
              optimizer: str) -> Plan:
    """A :class:`Plan` for ``path`` on ``network`` with its costs evaluated by us."""
    path = canonical_path(path, len(network.inputs))
    cost = evaluate_path(
        network.inputs, network.output, network.size_dict, path, objective, training
    )
    return Plan(kind=network.kind, equation=network.equation, sizes=network.size_dict,
                names=network.names, path=list(path), macs=cost.macs, peak=cost.peak,
                write=cost.write, cost=cost.cost, objective=objective,
                cotengra_version=cotengra.__version__, rows_bucket=network.size_dict.get(BATCH, 1),
                optimizer=optimizer, training=training)


def plan_network(network: Network, *, objective: str = "combo", training: bool = False,
                 autotune: bool = False, dtype: torch.dtype = torch.float32,
                 device_type: str = "cpu",
                 operands_example: Sequence[Tensor] | None = None) -> Plan:
    """Search the best tree of ``network`` (no caching; sizes are used as given)."""
    obj = parse_objective(objective)
    k = AUTOTUNE_CANDIDATES if autotune else 1
    paths, optimizer = search_paths(network, obj, training, k)
    cap = dense_weight_size(network)
    if cap is not None and largest_weight_intermediate(network, paths[0]) >= cap:
        # cheapest on paper, but it rebuilds the dense weight: search again without that
        paths, optimizer = search_paths(network, obj, training, k, max_weight_size=cap)
    plans = [make_plan(network, p, obj.name, training, optimizer) for p in paths]
    if autotune and network.kind == "tt_linear":
        reference = make_plan(
            network, tt_linear_reference_path(network), obj.name, training, "reference order"
        )
        if all(reference.path != plan.path for plan in plans):
            plans.append(reference)
    if not autotune or len(plans) < 2:
        return plans[0]
    operands = operands_example
    if operands is None:
        operands = example_operands(network, dtype, device_type)
    best = fastest(plans, operands, device_type)
    best.autotuned = True
    return best
