"""Order: how many modes per side a TT-linear layer gets, chosen by planned training cost.

Orders are compared at the same expressiveness, meaning the same parameter count: the
default order (``choose_order``, modes near 8-16) at the layer's rank cap sets the count,
and every other order gets the largest rank whose layer is no larger. Orders that cannot
come within ``SIMILAR_PARAMS`` of that count (their bonds clip first) are not comparable
and drop out. Among the rest, the one whose planned contraction costs least for a training
step (forward plus backward, by the planner's cost model, at the rows the example batch
feeds the layer) wins; ties keep the default order. Without example inputs there is no batch
to plan for, so the default order stays. Low-rank (order 1) is never picked here: it is fast
per row but loses accuracy at high compression, so it is used only when asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from comera_compile.formats import choose_order, tt_linear_modes
from comera_compile.passes.candidates import Candidate
from comera_compile.passes.specs import LOWRANK, TT, LayerSpec, make_spec, max_useful_rank
from comera_compile.planner import evaluate_path, get_plan, tt_linear_network

ORDERS = (2, 3, 4)
SIMILAR_PARAMS = 0.8  # an order must reach this share of the default order's parameters
ORDER_KEYS = ("order", "in_modes", "out_modes", "ranks")  # layer_config keys that fix it


@dataclass(frozen=True)
class OrderOption:
    """One order at the rank that matches the default order's parameter count."""

    order: int
    spec: LayerSpec
    cost: float  # planned training cost at ``rows`` (forward + backward)

    @property
    def params(self) -> int:
        return self.spec.params


@dataclass(frozen=True)
class OrderChoice:
    """The order a layer gets, the options it was chosen among, and why, in words."""

    chosen: OrderOption
    options: tuple[OrderOption, ...]
    rows: int
    reason: str


def planned_training_cost(
    spec: LayerSpec,
    rows: int,
    dtype: torch.dtype = torch.float32,
    device_type: str = "cpu",
    objective: str = "combo",
) -> float:
    """Forward + backward cost of the contraction tree the layer will run for ``rows`` rows.

    The tree is the layer's own (cached) forward plan; it is costed with the gradient-aware
    model, in which every step also pays the two backward contractions and their writes.
    """
    network = tt_linear_network(spec.in_modes, spec.out_modes, spec.ranks, rows)
    plan = get_plan(network, dtype=dtype, device_type=device_type, objective=objective)
    cost = evaluate_path(
        network.inputs, network.output, network.size_dict, plan.path, objective, training=True
    )
    return cost.cost


def _matching_spec(cand: Candidate, order: int, params: int) -> LayerSpec | None:
    """The spec of ``order`` at the largest rank with at most ``params`` parameters."""
    fin, fout = tt_linear_modes(cand.in_features, cand.out_features, order)
    if min(fin.modes) < 2 or min(fout.modes) < 2:  # a mode of 1 is a lower order in disguise
        return None
    spec = make_spec(cand, TT, 1, fin.modes, fout.modes)
    if spec.params > params:
        return None
    lo, hi = 1, max_useful_rank(spec)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        small = make_spec(cand, TT, mid, fin.modes, fout.modes).params <= params
        lo, hi = (mid, hi) if small else (lo, mid - 1)
    return make_spec(cand, TT, lo, fin.modes, fout.modes)


def _short(value: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value:.3g}"


def choose_tt_order(
    cand: Candidate,
    cap: int,
    rows: int,
    orders: tuple[int, ...] = ORDERS,
    objective: str = "combo",
) -> OrderChoice:
    """The TT order with the lowest planned training cost at ``rows`` rows per call, among
    ``orders`` at about the parameters the default order has at rank ``cap``."""
    default = max(choose_order(cand.in_features), choose_order(cand.out_features), 2)
    fin, fout = tt_linear_modes(cand.in_features, cand.out_features, default)
    reference = make_spec(cand, TT, cap, fin.modes, fout.modes)
    dtype, device_type = cand.weight.dtype, cand.weight.device.type
    if device_type == "meta":
        device_type = "cpu"
    options = []
    for order in sorted(set(orders) | {default}):
        spec = reference if order == default else _matching_spec(cand, order, reference.params)
        if spec is None or spec.params < SIMILAR_PARAMS * reference.params:
            continue
        cost = planned_training_cost(spec, rows, dtype, device_type, objective)
        options.append(OrderOption(order, spec, cost))
    best = min(options, key=lambda o: (o.cost, o.order != default, o.order))
    others = ", ".join(
        f"order {o.order} {_short(o.cost)}" for o in options if o is not best
    )
    reason = (
        f"lowest planned training cost at {rows} rows: {_short(best.cost)}"
        + (f" vs {others}" if others else " (no other order of similar size)")
        + f" at ~{_short(reference.params)} params"
    )
    return OrderChoice(best, tuple(options), rows, reason)


def pick_order(
    cand: Candidate,
    fmt: str,
    cap: int,
    rows: int | None,
    config: dict[str, Any] | None,
) -> tuple[LayerSpec | None, str]:
    """The spec (modes and rank cap) a layer should take, or None to keep its own, and why."""
    if cand.is_embedding:
        return None, ""
    if config and any(key in config for key in ORDER_KEYS):
        given = [key for key in ORDER_KEYS if key in config]
        return None, f"set in layer_config ({', '.join(given)})"
    if fmt == LOWRANK:
        return None, "one mode per side: format='lowrank' (W = U V)"
    if fmt != TT:
        return None, "default order (the order is chosen by cost for format='tt')"
    if rows is None:
        return None, "default order: no example_inputs to plan a batch for"
    choice = choose_tt_order(cand, cap, rows)
    return choice.chosen.spec, f"order {choice.chosen.order}: {choice.reason}"
