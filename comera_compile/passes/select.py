"""Select: which eligible layers to tensorize, and each one's ranks, to spend a budget well."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from comera_compile.formats import (
    LOWRANK,
    MONARCH,
    is_lowrank_table,
    monarch_blocks_for,
    monarch_modes,
)
from comera_compile.passes.allocate import (
    FILL,
    MIN_COMPRESSION,
    LayerPlan,
    Ranks,
    allocate,
    cheapest_states,
    totals_of,
)
from comera_compile.passes.budget import Budget
from comera_compile.passes.candidates import Candidate
from comera_compile.passes.eligible import DEFAULT_MAX_RANK, Option, dense_macs
from comera_compile.passes.layer_loss import capacity_loss, error_loss
from comera_compile.passes.specs import (
    BLOCK_FORMATS,
    TT,
    LayerSpec,
    make_spec,
)
from comera_compile.passes.spectra import layer_spectrum

MIN_COPIES = 3  # a layer in this many repeated blocks is tensorized in all or left as chosen


@dataclass
class Selection:
    """What ``select_layers`` decided, with the totals it predicts."""

    chosen: dict[str, tuple[Candidate, LayerSpec]]
    skipped: dict[str, str]
    rank: int
    before: dict[str, int | None]
    after: dict[str, int | None]
    limits: dict[str, float] = field(default_factory=dict)
    errors: dict[str, float] = field(default_factory=dict)  # predicted, init="dense" only
    shares: dict[str, float] = field(default_factory=dict)  # of the budget's first limit
    order_reasons: dict[str, str] = field(default_factory=dict)  # why each layer's TT order
    sensitivities: dict[str, float] = field(default_factory=dict)  # how much the output feels


class BudgetUnreachable(ValueError):
    """No choice of layers and ranks in the requested format meets the budget."""


def _unreachable(budget: Budget, before: dict, smallest: dict, limits: dict) -> ValueError:
    share = smallest["params"] / before["params"]
    parts = [f"{smallest['params']:,} parameters ({share:.1%} of the model)"]
    if "bytes" in limits:
        parts.append(f"{smallest['bytes']:,} bytes")
    if "macs" in limits:
        parts.append(f"{smallest['macs']:,} multiply-adds")
    return BudgetUnreachable(
        f"no choice of layers meets {budget}: smallest reachable: {', '.join(parts)} with every "
        "eligible layer at rank 1; raise the budget or include more layers"
    )


def layer_plan(option: Option, init: str = "random", max_rank: int | None = None,
               output_weight: float = 1.0, gram=None) -> LayerPlan:
    """The allocator's view of one option, with the loss that fits ``init``."""
    cache: dict[Ranks | None, dict[str, int]] = {}

    def change(ranks: Ranks | None) -> dict[str, int]:
        if ranks not in cache:
            cache[ranks] = ({"params": 0, "bytes": 0, "macs": 0} if ranks is None
                            else option.delta(option.spec(list(ranks))))
        return cache[ranks]

    dims = tuple(option.spec(1).chain_dims)
    fixed = tuple(option.fixed.ranks) if option.fixed is not None else None
    plan = LayerPlan(option.cand.name, dims, option.cand.dense_params, change, lambda r: 0.0,
                     per_bond=init == "dense", max_rank=max_rank, fixed=fixed,
                     forced=option.forced)
    if init == "dense" and option.fmt not in BLOCK_FORMATS:  # block formats: no spectrum
        # whitened by the inputs' Gram, the spectrum's errors are already output errors
        spec = option.spec(1)
        weighs = spec.format in (TT, LOWRANK) or (
            option.cand.is_embedding and is_lowrank_table(spec.in_modes, spec.out_modes))
        gram = gram if weighs else None
        option.spectrum = layer_spectrum(option.cand, spec, gram)
        option.whitened = gram is not None
        plan.loss = error_loss(option.spectrum, 1.0 if gram is not None else output_weight)
    else:
        plan.loss = capacity_loss(plan.dense_params, plan.params)
    return plan


def select_layers(options: list[Option], skipped: dict[str, str], budget: Budget | None,
                  before: dict[str, int | None], max_rank: int | None = None, init: str = "random",
                  output_weights: dict[str, float] | None = None, grams: dict | None = None,
                  sensitivities: dict[str, float] | None = None, reserve: int = 0) -> Selection:
    """Choose layers and each one's ranks so the model spends 95-100% of ``budget``, leaving
    ``reserve`` parameters (hot-row caches). ``init="dense"`` minimises the truncation error
    (per bond, as output errors where ``grams`` whiten it, times ``sensitivities``); ``"random"``
    compresses every layer alike. Without a budget every eligible layer gets the rank cap.
    """
    held = [o for o in options if o.held]
    if held:  # first without the layers held dense; with them only if the budget needs them
        kept = [o for o in options if not o.held]
        reasons = {**skipped, **{o.cand.name: o.held for o in held}}
        try:
            return select_layers(kept, reasons, budget, before, max_rank, init, output_weights,
                                 grams, sensitivities, reserve)
        except ValueError:  # unreachable without them: every layer competes
            pass
        for option in held:
            option.held = ""
    if budget is None:
        cap = max_rank or DEFAULT_MAX_RANK
        chosen = {o.cand.name: (o.cand, o.spec(cap)) for o in options}
        return Selection(chosen, skipped, cap, before, _totals_at(before, options, cap),
                         order_reasons=_order_reasons(options))
    limits = budget.limits(before["params"], before["bytes"], before["macs"])
    for key, size in (("params", reserve), ("bytes", 4 * reserve)):
        if key in limits:
            limits[key] -= size
    _size_monarch(options, skipped, before, limits)
    weights = output_weights or {}
    grams = grams or {}
    plans = [layer_plan(o, init, max_rank, weights.get(o.cand.name, 1.0), grams.get(o.cand.name))
             for o in options]
    _weigh_by_sensitivity(options, plans, sensitivities or {})
    base = {m: before[m] for m in limits}
    states = allocate(plans, base, limits)
    if states is None:
        smallest = totals_of(plans, cheapest_states(plans, limits), before)
        raise _unreachable(budget, before, smallest, limits)
    unlike = _unlike_copies(options, states) if init != "dense" else []
    while unlike:  # tensorize every copy, and spread the budget over them again
        for i in unlike:
            plans[i].forced = True
        again = allocate(plans, base, limits)
        if again is None:
            break
        states, unlike = again, _unlike_copies(options, again)
    if init != "dense":
        states = _alike_ranks(options, plans, states, base, limits)
    chosen, errors, shares = {}, {}, {}
    for option, plan, ranks in zip(options, plans, states):
        name = option.cand.name
        if ranks is None:
            felt = (f" (the output feels it {option.felt:.2f}x an average layer)"
                    if option.felt is not None else "")
            skipped[name] = "not needed to meet the budget" if init != "dense" else (
                "kept dense: compressing it costs more error per parameter saved than the "
                f"layers chosen{felt}; include it to force it")
            continue
        chosen[name] = (option.cand, option.spec(list(ranks)))
        shares[name] = _share(option, plan.change(ranks), limits)
        if option.spectrum is not None:
            errors[name] = math.sqrt(option.spectrum.relative_sq_error(ranks))
    after = totals_of(plans, states, before)
    rank = max((max(spec.ranks) for _, spec in chosen.values()), default=0)
    reasons = {k: v for k, v in _order_reasons(options).items() if k in chosen}
    felt = {o.cand.name: o.felt for o in options if o.felt is not None}
    return Selection(chosen, skipped, rank, before, after, limits, errors, shares, reasons,
                     felt)


def _size_monarch(options: list[Option], skipped: dict[str, str], before: dict,
                  limits: dict[str, float]) -> None:
    """Give each Monarch layer the user did not size its block count, in place: every one
    keeps the same share ``f`` of its dense weight, the largest ``f`` with which the model
    (other layers at their smallest) meets ``limits``. Monarch has no rank for the
    allocator to grow, so its size is settled here and then held fixed."""
    sized = [o for o in options if o.fmt == MONARCH and o.fixed is None]
    if not sized:
        return
    others = [o for o in options if o not in sized]
    base = {m: before[m] for m in limits}
    for option in others:  # the rest at their cheapest (rank 1, or as the user fixed them)
        for metric, change in option.delta(option.spec(1)).items():
            if metric in base:
                base[metric] += change

    def specs_at(share: float) -> list[LayerSpec | None]:
        out = []
        for o in sized:
            blocks = monarch_blocks_for(o.cand.in_features, o.cand.out_features,
                                        share * o.cand.in_features * o.cand.out_features)
            out.append(None if blocks is None else make_spec(
                o.cand, MONARCH, 1, *monarch_modes(o.cand.in_features, o.cand.out_features,
                                                   blocks)))
        return out

    def fits(specs: list[LayerSpec | None]) -> bool:
        totals = dict(base)
        for option, spec in zip(sized, specs):
            if spec is not None:
                for metric, change in option.delta(spec).items():
                    if metric in totals:
                        totals[metric] += change
        return all(totals[m] <= cap for m, cap in limits.items())

    lo, hi = 0.0, 1.0 / MIN_COMPRESSION
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if fits(specs_at(mid)) else (lo, mid)
    for option, spec in zip(sized, specs_at(lo)):
        if spec is None:  # not even the most blocks fit: the budget check then says so
            continue
        option.in_modes, option.out_modes = spec.in_modes, spec.out_modes
        option.fixed = spec


def block_place(name: str) -> str:
    """A layer's place in the model's repeated blocks: its name with the stack indices
    starred (``model.layers.3.mlp.up_proj`` -> ``model.layers.*.mlp.up_proj``)."""
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


def _copies(options: list[Option]) -> list[list[int]]:
    """The indices of each layer's copies in ``MIN_COPIES`` or more repeated blocks (same
    place in the block, format and modes)."""
    copies: dict[tuple, list[int]] = {}
    for i, option in enumerate(options):
        place = block_place(option.cand.name)
        if place != option.cand.name and option.fixed is None:
            key = (place, option.fmt, option.in_modes, option.out_modes)
            copies.setdefault(key, []).append(i)
    return [members for members in copies.values() if len(members) >= MIN_COPIES]


def _unlike_copies(options: list[Option], states: list[Ranks | None]) -> list[int]:
    """The layers the allocator left dense where copies in ``MIN_COPIES`` or more repeated
    blocks are tensorized: from scratch such a copy only spent the last of the budget, and
    makes its block a shape (a compiled graph) of its own."""
    unlike = []
    for members in _copies(options):
        dense = [i for i in members if states[i] is None]
        if 0 < len(dense) < len(members):
            unlike += dense
    return unlike


def _alike_ranks(options: list[Option], plans: list[LayerPlan], states: list[Ranks | None],
                 base: dict[str, float], limits: dict[str, float]) -> list[Ranks | None]:
    """``states`` with the tensorized copies of each layer in ``MIN_COPIES`` or more repeated
    blocks at the least of their ranks, bond by bond, so the blocks keep one shape; kept as
    allocated where that leaves the budget under ``FILL`` spent."""
    alike = list(states)
    for members in _copies(options):
        ranks = [states[i] for i in members]
        if any(r is None for r in ranks) or len(set(ranks)) == 1:
            continue
        least = tuple(map(min, *ranks))
        for i in members:
            alike[i] = least
    totals = totals_of(plans, alike, base)
    spent = max(totals[m] / cap for m, cap in limits.items())  # as the allocator's fill
    return alike if spent >= FILL else states


def _weigh_by_sensitivity(options: list[Option], plans: list[LayerPlan],
                          sensitivities: dict[str, float]) -> None:
    """Scale each layer's loss by how much the model's output feels it. A sensitivity scales
    a relative *output* error, which only whitened spectra give (TT, low rank); a TTM
    spectrum is the weight's error, on another scale, so with one among them none is."""
    if not sensitivities or not all(o.whitened for o in options):
        return
    for option, plan in zip(options, plans):
        felt = sensitivities.get(option.cand.name, 1.0)
        if felt != 1.0:
            option.felt = felt
            plan.loss = error_loss(option.spectrum, felt)


def _share(option: Option, change: dict[str, int], limits: dict[str, float]) -> float:
    """What the layer holds of the budget's first limit (params, else bytes, else MACs)."""
    metric = next(m for m in ("params", "bytes", "macs") if m in limits)
    dense = {"params": option.cand.dense_params, "bytes": option.cand.dense_bytes,
             "macs": dense_macs(option.cand, option.shape)}[metric]
    return (dense + change[metric]) / limits[metric]


def _totals_at(before: dict, options: list[Option], rank: int) -> dict[str, int | None]:
    after = dict(before)
    for option in options:
        for metric, change in option.delta(option.spec(rank)).items():
            if after[metric] is not None:
                after[metric] += change
    return after


def _order_reasons(options: list[Option]) -> dict[str, str]:
    return {o.cand.name: o.why for o in options if o.why}
