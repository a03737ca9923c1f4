"""Select: which layers to tensorize, and each one's ranks, to spend a budget well.

Eligibility first: layers too small to win, small classifier heads, narrow layers (at most
16 inputs or outputs: one TT bond would cap their rank), layers the forward never calls and
anything the user excluded stay dense, each with its reason. Small ``sparse=True`` tables are
held dense while the budget can be met without them. Then the allocator
(``allocate.py``) picks every other layer's ranks, per bond for pretrained weights, so the
model lands between 95% and 100% of the budget, minimising the objective that fits the init
(``objectives.py``). Training from scratch, where it tensorized some copies of a layer in
repeated blocks and left others dense, all are tensorized and the budget spread again
(``_unlike_copies``), and copies' ranks are made alike (``_alike_ranks``), so the blocks
keep one shape. Without a budget every eligible layer gets the rank cap (30, as CoMERA).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from comera_compile.formats import (
    COLA,
    LOWRANK,
    MONARCH,
    TT_EMBEDDING,
    chain_layout,
    is_lowrank_table,
    lowrank_table_modes,
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
from comera_compile.passes.candidates import CONV1D, LINEAR, Candidate
from comera_compile.passes.objectives import capacity_loss, error_loss
from comera_compile.passes.order import pick_order
from comera_compile.passes.shapes import LayerShape
from comera_compile.passes.specs import (
    BLOCK_FORMATS,
    LINEAR_FORMATS,
    TT,
    LayerSpec,
    auto_modes,
    make_spec,
)
from comera_compile.passes.spectra import Spectrum, layer_spectrum
from comera_compile.passes.targets import Names, check_layer_config, config_for, user_skip

DEFAULT_MAX_RANK = 30  # the reference's r
MIN_PARAMS = 4096  # smaller layers stay dense: launch overhead beats any saving
HEAD_CLASSES = 16  # Linear layers with fewer outputs are classifier heads: kept dense
NARROW = 16  # Linear layers with at most this many inputs or outputs are kept dense
MIN_SPARSE_TABLE = 1 << 18  # sparse=True tables with fewer entries are kept dense
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


@dataclass
class _Option:
    """An eligible layer: its settings and rank cap; ``fixed`` when the user gave ranks."""

    cand: Candidate
    fmt: str
    in_modes: tuple[int, ...]
    out_modes: tuple[int, ...]
    cap: int
    shape: LayerShape | None
    fixed: LayerSpec | None = None
    forced: bool = False
    spectrum: Spectrum | None = None
    felt: float | None = None  # the output sensitivity its error was weighed by, if any
    whitened: bool | None = None  # whether its spectrum gives output errors (init="dense")
    why: str = ""  # why this order (modes per side)
    held: str = ""  # why it stays dense unless the budget needs it
    configured: bool = False  # the user's layer_config names this layer

    def spec(self, rank: int | list[int]) -> LayerSpec:
        if self.fixed is not None:
            return self.fixed
        if isinstance(rank, int):
            rank = min(rank, self.cap)
        return make_spec(self.cand, self.fmt, rank, self.in_modes, self.out_modes)

    def delta(self, spec: LayerSpec) -> dict[str, int]:
        """Change of each total when this layer becomes ``spec``."""
        elsize = self.cand.weight.element_size()
        change = {
            "params": spec.params - self.cand.dense_params,
            "bytes": spec.params * elsize - self.cand.dense_bytes,
            "macs": 0,
        }
        if self.shape is not None:
            change["macs"] = spec.macs(self.shape.total_rows, self.shape.calls) - dense_macs(
                self.cand, self.shape
            )
        return change


def dense_macs(cand: Candidate, shape: LayerShape | None) -> int:
    if shape is None or cand.is_embedding:
        return 0
    return shape.total_rows * cand.in_features * cand.out_features


def _format_for(cand: Candidate, requested: str | None, default: str, name: str) -> str:
    if cand.is_embedding:
        if requested not in (None, TT_EMBEDDING, "ttm"):
            raise ValueError(f"layer_config for '{name}': embeddings take format "
                             f"'{TT_EMBEDDING}', got {requested!r}")
        return TT_EMBEDDING
    fmt = requested or default
    if fmt not in LINEAR_FORMATS:
        raise ValueError(f"format for '{name}' must be one of {LINEAR_FORMATS}, got {fmt!r}")
    return fmt


def _chained(cfg: dict[str, Any], keys: tuple[str, str]) -> bool:
    """Whether a layer_config entry describes a chain: several modes, ranks, or an order."""
    modes = [cfg.get(k) for k in keys]
    ranks = cfg.get("ranks")
    order = cfg.get("order")
    return any(isinstance(m, (list, tuple)) and len(m) > 1 for m in modes) or (
        isinstance(ranks, (list, tuple)) and len(ranks) > 1) or (
        isinstance(order, int) and order > 1)


def _configured(cand: Candidate, cfg: dict[str, Any], default_fmt: str,
                named: bool = False) -> _Option:
    """An option from layer_config, checked by computing the layer's layout. Without a
    format named (here or for the whole model), modes or ranks of a chain mean TT."""
    keys = ("row_modes", "col_modes") if cand.is_embedding else ("in_modes", "out_modes")
    in_modes, out_modes = cfg.get(keys[0]), cfg.get(keys[1])
    if (cfg.get("format") is None and not named and default_fmt in (LOWRANK, COLA)
            and _chained(cfg, keys)):
        default_fmt = TT
    fmt = _format_for(cand, cfg.get("format"), default_fmt, cand.name)
    ranks = cfg.get("ranks", 1)
    sized = "ranks" in cfg
    try:
        if "blocks" in cfg:
            if fmt != MONARCH:
                raise ValueError(f"blocks= sets a Monarch layer's size; format {fmt!r} "
                                 "takes ranks= instead")
            in_modes, out_modes = monarch_modes(cand.in_features, cand.out_features,
                                                cfg["blocks"])
        sized = sized or (fmt == MONARCH and (in_modes or out_modes) is not None)
        chain = chain_layout(fmt, cand.in_features, cand.out_features, ranks, in_modes,
                             out_modes, cfg.get("order"))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"layer_config for '{cand.name}': {exc}") from None
    ins, outs = chain.first, chain.second
    option = _Option(cand, fmt, tuple(ins), tuple(outs), 1, None, forced=True)
    if sized:
        option.fixed = make_spec(cand, fmt, chain.ranks, ins, outs)
    return option


def _rank_cap(option: _Option, max_rank: int | None) -> int:
    """``max_rank`` if given; else the largest rank <= 30 where the layer stays 2x smaller."""
    if max_rank is not None:
        return max_rank
    lo, hi = 1, DEFAULT_MAX_RANK
    while lo < hi:
        mid = (lo + hi + 1) // 2
        spec = make_spec(option.cand, option.fmt, mid, option.in_modes, option.out_modes)
        small = spec.params * MIN_COMPRESSION <= option.cand.dense_params
        lo, hi = (mid, hi) if small else (lo, mid - 1)
    return lo


def _default_skip(cand: Candidate) -> str | None:
    if cand.kind in (LINEAR, CONV1D) and cand.out_features < HEAD_CLASSES:
        return (f"small output head ({cand.out_features} outputs) kept dense for accuracy; "
                "include it to override")
    if cand.kind in (LINEAR, CONV1D) and min(cand.in_features, cand.out_features) <= NARROW:
        return (f"narrow ({cand.in_features} -> {cand.out_features}): every input reaches every "
                "output through one TT bond, so its rank would cap the layer's; "
                "include it to override")
    if cand.dense_params < MIN_PARAMS:
        return f"too small ({cand.dense_params:,} parameters < {MIN_PARAMS:,})"
    return None


def _held_dense(cand: Candidate) -> str:
    """Why a layer stays dense unless the budget cannot be met without it (else "")."""
    if cand.is_embedding and getattr(cand.module, "sparse", False) and (
            cand.dense_params < MIN_SPARSE_TABLE):
        return (f"small sparse table ({cand.dense_params:,} entries < {MIN_SPARSE_TABLE:,}): "
                "its lookup and sparse update cost less than a TT lookup's fixed cost per call "
                "(tens of small kernels); tensorized only when the budget needs it, or include it")
    return ""


def eligible_options(
    candidates: list[Candidate],
    shapes: dict[str, LayerShape] | None,
    called: set[str] | None,
    include: Names,
    exclude: Names,
    filter_fn: Callable[[nn.Module, str], bool] | None,
    layer_config: dict[str, dict] | None,
    fmt: str,
    max_rank: int | None,
    named: bool = False,
) -> tuple[list[_Option], dict[str, str]]:
    """The layers that may be tensorized, and why each other layer stays dense. ``named``:
    ``fmt`` is the user's own choice, not the default (see ``_configured``)."""
    layer_config = check_layer_config(layer_config)
    options, skipped = [], {}
    for cand in candidates:
        names = (cand.name, *cand.aliases)
        cfg = config_for(cand.name, layer_config)
        reason = cand.skip
        if reason is None and called is not None and not called.intersection(names):
            reason = "not called in the forward"
        reason = reason or user_skip(cand.name, cand.module, include, exclude, filter_fn,
                                     cfg is not None)
        explicit = cfg is not None or (include is not None)
        if reason is None and not explicit:
            reason = _default_skip(cand)
        if reason is not None:
            skipped[cand.name] = reason
            continue
        if cfg is not None:
            option = _configured(cand, cfg, fmt, named)
            option.configured = True
        else:
            layer_fmt = _format_for(cand, None, fmt, cand.name)
            ins, outs = auto_modes(cand, layer_fmt)
            option = _Option(cand, layer_fmt, ins, outs, 1, None, forced=include is not None)
            smallest = make_spec(cand, layer_fmt, 1, ins, outs).params
            if layer_fmt != MONARCH and smallest * MIN_COMPRESSION > cand.dense_params:
                skipped[cand.name] = f"less than {MIN_COMPRESSION:g}x smaller even at rank 1"
                continue
        if not explicit:
            option.held = _held_dense(cand)
        option.shape = (shapes or {}).get(cand.name)
        option.cap = _rank_cap(option, max_rank)
        rows = option.shape.rows if option.shape is not None else None
        ordered, option.why = pick_order(cand, option.fmt, option.cap, rows, cfg)
        if ordered is not None:  # same parameters, cheapest training step: its own rank cap
            option.in_modes, option.out_modes = ordered.in_modes, ordered.out_modes
            option.cap = max(ordered.ranks)
        options.append(option)
    return options, skipped


def weigh_tables(options: list[_Option], grams: dict, max_rank: int | None) -> None:
    """Give each embedding table with row frequencies in ``grams`` (and no layer_config)
    the low-rank layout, in place: the one table layout whose truncation can weigh rows by
    how often they are looked up (``formats.whiten``), so the frequent rows stay close."""
    for option in options:
        cand = option.cand
        if not cand.is_embedding or option.configured or grams.get(cand.name) is None:
            continue
        ins, outs = lowrank_table_modes(cand.in_features, cand.out_features)
        if make_spec(cand, TT_EMBEDDING, 1, ins, outs).params * MIN_COMPRESSION > (
                cand.dense_params):
            continue  # a narrow table: even rank 1 would not halve it
        option.in_modes, option.out_modes = ins, outs
        option.cap = _rank_cap(option, max_rank)
        option.why = ("low rank (A B) with rows weighted by how often the example inputs "
                      "look them up: the table layout whose truncation keeps frequent rows")


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


def layer_plan(
    option: _Option,
    init: str = "random",
    max_rank: int | None = None,
    output_weight: float = 1.0,
    gram=None,
) -> LayerPlan:
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


def select_layers(
    options: list[_Option],
    skipped: dict[str, str],
    budget: Budget | None,
    before: dict[str, int | None],
    max_rank: int | None = None,
    init: str = "random",
    output_weights: dict[str, float] | None = None,
    grams: dict | None = None,
    sensitivities: dict[str, float] | None = None,
) -> Selection:
    """Choose layers and each one's ranks so the model spends 95-100% of ``budget``.

    ``init="dense"`` minimises the weights' truncation error (per bond, from singular values,
    as output errors where ``grams`` whiten them, times the layer's ``sensitivities``, how
    much the model's output feels it; else weighted by ``output_weights``);
    ``"random"`` compresses every layer alike.
    Without a budget every eligible layer is tensorized at the rank cap (30 by default).
    """
    held = [o for o in options if o.held]
    if held:  # first without the layers held dense; with them only if the budget needs them
        kept = [o for o in options if not o.held]
        reasons = {**skipped, **{o.cand.name: o.held for o in held}}
        try:
            return select_layers(kept, reasons, budget, before, max_rank, init, output_weights,
                                 grams, sensitivities)
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


def _size_monarch(options: list[_Option], skipped: dict[str, str], before: dict,
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


def _copies(options: list[_Option]) -> list[list[int]]:
    """The indices of each layer's copies in ``MIN_COPIES`` or more repeated blocks (same
    place in the block, format and modes)."""
    copies: dict[tuple, list[int]] = {}
    for i, option in enumerate(options):
        place = block_place(option.cand.name)
        if place != option.cand.name and option.fixed is None:
            key = (place, option.fmt, option.in_modes, option.out_modes)
            copies.setdefault(key, []).append(i)
    return [members for members in copies.values() if len(members) >= MIN_COPIES]


def _unlike_copies(options: list[_Option], states: list[Ranks | None]) -> list[int]:
    """The layers the allocator left dense where copies of them in ``MIN_COPIES`` or more
    repeated blocks are tensorized. Training from scratch, every layer is compressed
    alike, so one copy left dense only spent the last of the budget; but it makes its
    block another shape than the rest, a compiled graph (and a first compile) of its own.
    Tensorized too, it costs that budget back in the copies' ranks."""
    unlike = []
    for members in _copies(options):
        dense = [i for i in members if states[i] is None]
        if 0 < len(dense) < len(members):
            unlike += dense
    return unlike


def _alike_ranks(options: list[_Option], plans: list[LayerPlan], states: list[Ranks | None],
                 base: dict[str, float], limits: dict[str, float]) -> list[Ranks | None]:
    """``states`` with the tensorized copies of each layer in ``MIN_COPIES`` or more
    repeated blocks at the least of their ranks, bond by bond. Training from scratch the
    copies differ only where the budget's last rank increments ran out (14 in three
    blocks, 13 in the fourth): a block of other ranks is another shape, so compiled at
    static ranks it runs eager or needs a graph of its own. Lowering ranks only frees
    budget; kept as allocated if that leaves it under ``FILL`` spent."""
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


def _weigh_by_sensitivity(options: list[_Option], plans: list[LayerPlan],
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


def _share(option: _Option, change: dict[str, int], limits: dict[str, float]) -> float:
    """What the layer holds of the budget's first limit (params, else bytes, else MACs)."""
    metric = next(m for m in ("params", "bytes", "macs") if m in limits)
    dense = {"params": option.cand.dense_params, "bytes": option.cand.dense_bytes,
             "macs": dense_macs(option.cand, option.shape)}[metric]
    return (dense + change[metric]) / limits[metric]


def _totals_at(before: dict, options: list[_Option], rank: int) -> dict[str, int | None]:
    after = dict(before)
    for option in options:
        for metric, change in option.delta(option.spec(rank)).items():
            if after[metric] is not None:
                after[metric] += change
    return after


def _order_reasons(options: list[_Option]) -> dict[str, str]:
    return {o.cand.name: o.why for o in options if o.why}
