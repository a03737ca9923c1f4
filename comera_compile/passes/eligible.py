"""Eligibility: which layers may be tensorized, in which format, order and rank cap."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from comera_compile.formats import (
    COLA,
    LOWRANK,
    MONARCH,
    TT_EMBEDDING,
    chain_layout,
    lowrank_table_modes,
    monarch_modes,
)
from comera_compile.passes.allocate import (
    MIN_COMPRESSION,
)
from comera_compile.passes.candidates import CONV1D, LINEAR, Candidate
from comera_compile.passes.order import pick_order
from comera_compile.passes.shapes import LayerShape
from comera_compile.passes.specs import (
    LINEAR_FORMATS,
    TT,
    LayerSpec,
    auto_modes,
    make_spec,
)
from comera_compile.passes.spectra import Spectrum
from comera_compile.passes.targets import Names, check_layer_config, config_for, user_skip

DEFAULT_MAX_RANK = 30  # the reference's r
MIN_PARAMS = 4096  # smaller layers stay dense: launch overhead beats any saving
HEAD_CLASSES = 16  # Linear layers with fewer outputs are classifier heads: kept dense
NARROW = 16  # Linear layers with at most this many inputs or outputs are kept dense
MIN_SPARSE_TABLE = 1 << 18  # sparse=True tables with fewer entries are kept dense
TOKEN_ENDS_SHARE = 0.1  # a from-scratch LM's embedding and head, held dense up to this share


@dataclass
class Option:
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
        change = {"params": spec.params - self.cand.dense_params,
                  "bytes": spec.params * elsize - self.cand.dense_bytes, "macs": 0}
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
                named: bool = False) -> Option:
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
    option = Option(cand, fmt, tuple(ins), tuple(outs), 1, None, forced=True)
    if sized:
        option.fixed = make_spec(cand, fmt, chain.ranks, ins, outs)
    return option


def _rank_cap(option: Option, max_rank: int | None) -> int:
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
                "(its Python and autograd calls); tensorized only when the budget needs it, or "
                "include it")
    return ""


def hold_token_ends(options: list[Option], model: nn.Module) -> None:
    """Training from scratch, hold a language model's token embedding and output head dense
    unless the budget cannot be met without them."""
    ends: list[nn.Module] = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            module = getattr(model, getter)()
        except (AttributeError, NotImplementedError, TypeError):
            continue
        if isinstance(module, nn.Module):
            ends.append(module)
    held = [o for o in options if any(o.cand.module is end for end in ends)
            and not (o.forced or o.configured or o.held)]
    total = sum(p.numel() for p in model.parameters())
    if sum(o.cand.dense_params for o in held) > TOKEN_ENDS_SHARE * total:
        return
    for option in held:
        option.held = ("the token embedding or output head of a language model trained "
                       "from scratch: kept dense unless the budget needs it, or include it")


def eligible_options(candidates: list[Candidate], shapes: dict[str, LayerShape] | None,
                     called: set[str] | None, include: Names, exclude: Names,
                     filter_fn: Callable[[nn.Module, str], bool] | None,
                     layer_config: dict[str, dict] | None, fmt: str, max_rank: int | None,
                     named: bool = False,
                     from_scratch: bool = False) -> tuple[list[Option], dict[str, str]]:
    """The layers that may be tensorized, and why each other layer stays dense. ``named``:
    ``fmt`` is the user's own choice, not the default (see ``_configured``);
    ``from_scratch``: the layers start from random cores (``passes.order.pick_order``)."""
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
            option = Option(cand, layer_fmt, ins, outs, 1, None, forced=include is not None)
            smallest = make_spec(cand, layer_fmt, 1, ins, outs).params
            if layer_fmt != MONARCH and smallest * MIN_COMPRESSION > cand.dense_params:
                skipped[cand.name] = f"less than {MIN_COMPRESSION:g}x smaller even at rank 1"
                continue
        if not explicit:
            option.held = _held_dense(cand)
        option.shape = (shapes or {}).get(cand.name)
        option.cap = _rank_cap(option, max_rank)
        rows = option.shape.rows if option.shape is not None else None
        ordered, option.why = pick_order(cand, option.fmt, option.cap, rows, cfg,
                                           from_scratch)
        if ordered is not None:  # same parameters, cheapest training step: its own rank cap
            option.in_modes, option.out_modes = ordered.in_modes, ordered.out_modes
            option.cap = max(ordered.ranks)
        options.append(option)
    return options, skipped


def weigh_tables(options: list[Option], grams: dict, max_rank: int | None) -> None:
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


