"""Order: how many modes per side a TT layer gets, chosen by what a training step costs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from comera_compile.formats import (
    ONE_MODE,
    TT_EMBEDDING,
    chain_layout,
    choose_order,
    lowrank_table_modes,
    tt_linear_modes,
)
from comera_compile.passes.candidates import Candidate
from comera_compile.passes.specs import (
    BLOCK_FORMATS,
    TT,
    LayerSpec,
    make_spec,
    max_useful_rank,
)
from comera_compile.planner import evaluate_path, get_plan, tt_linear_network

ORDERS = (2, 3, 4)
EMBEDDING_ORDERS = (2, 3, 4, 5, 6)
MAX_FLOOR = 0.005  # another table layout must hold under this share of the table at rank 1
SIMILAR_PARAMS = 0.8  # an order must reach this share of the default order's parameters
ORDER_KEYS = ("order", "in_modes", "out_modes", "ranks")  # layer_config keys that fix it
EMBEDDING_ORDER_KEYS = ("order", "row_modes", "col_modes", "ranks")


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


def planned_training_cost(spec: LayerSpec, rows: int, dtype: torch.dtype = torch.float32,
                          device_type: str = "cpu", objective: str = "combo") -> float:
    """Forward + backward cost of the contraction tree the layer will run for ``rows`` rows."""
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
    return _largest_spec(cand, TT, fin.modes, fout.modes, params)


def _largest_spec(cand: Candidate, fmt: str, ins: tuple[int, ...], outs: tuple[int, ...],
                  params: int) -> LayerSpec | None:
    """The spec with these modes at the largest rank with at most ``params`` parameters."""
    spec = make_spec(cand, fmt, 1, ins, outs)
    if spec.params > params:
        return None
    lo, hi = 1, max_useful_rank(spec)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        small = make_spec(cand, fmt, mid, ins, outs).params <= params
        lo, hi = (mid, hi) if small else (lo, mid - 1)
    return make_spec(cand, fmt, lo, ins, outs)


def _short(value: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value:.3g}"


def choose_tt_order(cand: Candidate, cap: int, rows: int, orders: tuple[int, ...] = ORDERS,
                    objective: str = "combo") -> OrderChoice:
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
    others = ", ".join(f"order {o.order} {_short(o.cost)}" for o in options if o is not best)
    reason = (
        f"lowest planned training cost at {rows} rows: {_short(best.cost)}"
        + (f" vs {others}" if others else " (no other order of similar size)")
        + f" at ~{_short(reference.params)} params"
    )
    return OrderChoice(best, tuple(options), rows, reason)


def _embedding_layouts(cand: Candidate, order: int | None) -> list[tuple[tuple[int, ...], ...]]:
    """Row and column modes of the table at ``order`` (the default one for None): the default
    split of the embedding dim, and the whole dim in the last core."""
    try:
        chain = chain_layout(TT_EMBEDDING, cand.in_features, cand.out_features, 1, order=order)
    except ValueError:
        return []
    if min(chain.first) < 2:  # a row mode of 1 is a lower order in disguise
        return []
    last = (1,) * (len(chain.first) - 1) + (cand.out_features,)
    return list(dict.fromkeys([(chain.first, chain.second), (chain.first, last)]))


def choose_embedding_order(cand: Candidate, cap: int,
                           orders: tuple[int, ...] = EMBEDDING_ORDERS) -> OrderChoice:
    """The table's layout with the fewest multiply-adds per looked-up row, among ``orders``
    (each with the default split of the embedding dim, and with the whole dim in the last
    core) at about the parameters the default layout has at rank ``cap``."""
    default_modes = _embedding_layouts(cand, None)[0]
    reference = make_spec(cand, TT_EMBEDDING, cap, *default_modes)
    orders = tuple(sorted(set(orders) | {len(default_modes[0])}))
    options = _table_options(cand, reference.params, orders, default=(default_modes, reference))
    best = min(options, key=lambda o: (o.cost, o.spec != reference, o.order))
    runners = {}  # the cheapest other layout of each order
    for o in sorted(options, key=lambda o: -o.cost):
        if o is not best:
            runners[o.order] = o
    others = ", ".join(f"{_layout(o)} {_short(o.cost)}" for _, o in sorted(runners.items()))
    reason = (
        f"fewest multiply-adds per looked-up row: {_short(best.cost)} with dim modes "
        f"{list(best.spec.col_modes)}"
        + (f" vs {others}" if others else " (no other layout of similar size)")
        + f" at ~{_short(reference.params)} params"
    )
    if best.spec != reference:
        default_option = next(o for o in options if o.spec == reference)
        reason += f" (default {_layout(default_option)} {_short(default_option.cost)})"
    return OrderChoice(best, tuple(options), 1, reason)


def reorder_tables(chosen: dict[str, tuple[Candidate, LayerSpec]], keep: set[str],
                   max_rank: int | None = None) -> dict[str, str]:
    """Choose each recommender table's layout again at the parameters the budget gave it,
    in place, and say why. ``choose_embedding_order`` compares layouts before the budget is
    spread, at a rank cap's size; a table given many times that size can be far cheaper in
    another order (three cores at rank 100 build a row from 100 x 100 slices, two cores of
    the same size from one rank-wide vector). Never more parameters; ``keep``: tables whose
    layout the user set."""
    reasons = {}
    for name, (cand, spec) in list(chosen.items()):
        if (name in keep or spec.format != TT_EMBEDDING
                or not getattr(cand.module, "sparse", False)):
            continue
        current = spec.macs_per_row()
        options = _table_options(cand, spec.params, max_rank=max_rank)
        if not options:
            continue
        best = min(options, key=lambda o: (o.cost, o.order))
        if best.cost >= current:
            continue
        chosen[name] = (cand, best.spec)
        reasons[name] = (
            f"order {best.order}: fewest multiply-adds per looked-up row at the "
            f"~{_short(spec.params)} parameters the budget gave it: {_short(best.cost)} with dim "
            f"modes {list(best.spec.col_modes)} (order {len(spec.col_modes)} "
            f"{list(spec.col_modes)} would cost {_short(current)})")
    return reasons


def _table_options(cand: Candidate, params: int, orders: tuple[int, ...] = EMBEDDING_ORDERS,
                   max_rank: int | None = None,
                   default: tuple[Any, LayerSpec] | None = None) -> list[OrderOption]:
    """Each table layout of ``orders`` at the largest rank within ``params`` (and
    ``max_rank``) that reaches ``SIMILAR_PARAMS`` of them. ``default``: ``(modes, spec)`` of
    a layout taken as it is; any other must hold under ``MAX_FLOOR`` of the table at rank 1,
    or it would limit how far a budget can compress the table."""
    options = []
    for order in orders:
        for modes in _embedding_layouts(cand, order):
            if len(modes[0]) != order:
                continue
            if default is not None and modes == default[0]:
                spec = default[1]
            elif make_spec(cand, TT_EMBEDDING, 1, *modes).params > MAX_FLOOR * cand.dense_params:
                continue
            else:
                spec = _largest_spec(cand, TT_EMBEDDING, *modes, params)
                if spec is not None and max_rank is not None and max(spec.ranks) > max_rank:
                    spec = make_spec(cand, TT_EMBEDDING, max_rank, *modes)
            if spec is None or spec.params < SIMILAR_PARAMS * params:
                continue
            options.append(OrderOption(order, spec, spec.macs_per_row()))
    return options


FACTORIZED_TABLE = ("low rank (A B): a table trained from scratch that is not a recommender's "
                    "is factorized as ALBERT factorizes its word embeddings; a lookup is one "
                    "narrow gather and one matmul")


def factorized_table(cand: Candidate) -> LayerSpec | None:
    """The low-rank layout of a table, ``A (rows, r) @ B (r, dim)``, at its full rank, or
    None for a table too narrow for it (over ``MAX_FLOOR`` of the table at rank 1, as for
    the other layouts). A language model's token table is looked up for every token of a
    batch; a TT chain of three or more cores builds each row from rank-wide slices (or
    buckets them), where this layout costs one matmul of the looked-up rows, and its
    backward one more (``benchmarks/token_table.py`` times both)."""
    ins, outs = lowrank_table_modes(cand.in_features, cand.out_features)
    spec = make_spec(cand, TT_EMBEDDING, 1, ins, outs)
    if spec.params > MAX_FLOOR * cand.dense_params:
        return None
    return make_spec(cand, TT_EMBEDDING, max_useful_rank(spec), ins, outs)


def _layout(option: OrderOption) -> str:
    return f"order {option.order} {list(option.spec.col_modes)}"


def pick_order(cand: Candidate, fmt: str, cap: int, rows: int | None,
               config: dict[str, Any] | None,
               from_scratch: bool = False) -> tuple[LayerSpec | None, str]:
    """The spec (modes and rank cap) a layer should take, or None to keep its own, and why.
    A table's layout is chosen by cost where it is a recommender's (``sparse=True``) or
    trains ``from_scratch``; a pretrained table's keeps the default layout, which sets how
    much of its weights a truncation keeps."""
    keys = EMBEDDING_ORDER_KEYS if cand.is_embedding else ORDER_KEYS
    if config and any(key in config for key in keys):
        given = [key for key in keys if key in config]
        return None, f"set in layer_config ({', '.join(given)})"
    if cand.is_embedding:
        if getattr(cand.module, "sparse", False):
            choice = choose_embedding_order(cand, cap)
            return choice.chosen.spec, f"order {choice.chosen.order}: {choice.reason}"
        if from_scratch and (factorized := factorized_table(cand)) is not None:
            return factorized, FACTORIZED_TABLE
        return None, ""
    if fmt in ONE_MODE:
        return None, f"one mode per side: format={fmt!r} (W = U V)"
    if fmt in BLOCK_FORMATS:
        return None, f"two block-diagonal factors: format={fmt!r} (two batched matmuls)"
    if fmt != TT:
        return None, "default order (the order is chosen by cost for format='tt')"
    if rows is None:
        return None, "default order: no example_inputs to plan a batch for"
    choice = choose_tt_order(cand, cap, rows)
    return choice.chosen.spec, f"order {choice.chosen.order}: {choice.reason}"
