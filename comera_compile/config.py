"""The two configuration objects: :class:`CompressionConfig` for ``optimize`` and
:class:`CompileOptions` for the ``comera`` backend.

Both are dataclasses checked when built (a bad value fails at once, with the accepted
values in the message), and both turn into plain JSON-able dicts and back
(``to_dict`` / ``from_dict``). ``optimize`` keeps the configuration it ran with in the
model's report, so ``save`` writes it into the checkpoint and :func:`config_of` reads it
back from a loaded model::

    config = cc.CompressionConfig(budget="40x", format="tt", max_rank=16,
                                  compile_options=cc.CompileOptions(memory="low"))
    model = cc.optimize(model, config)
    cc.config_of(model) == config          # also after save / load

Budget forms (``CompressionConfig.budget`` and ``optimize``'s ``budget``): a float in
(0, 1] is the share of parameters to **keep** (``0.05``: 5%, ``1.0``: everything); a
string ``"40x"`` or ``Budget(ratio=40)`` is a **compression ratio**, 40 times smaller
(the same as ``0.025``); an int is a parameter **count**, so small ints that read like a
share or a ratio (``1``, ``40``, ``100``) are refused with the spelling that was probably
meant. (The rank-adaptive trainer's ``target_ratio=0.2`` is a share to keep, like the
float budget, not a compression ratio.)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from comera_compile.formats import positive_int
from comera_compile.passes import Budget, check_format, check_init, parse_budget
from comera_compile.passes.choose import AUTO
from comera_compile.passes.report import report_of
from comera_compile.passes.targets import check_layer_config
from comera_compile.planner import parse_objective

RECOMPUTE_MODES = (None, "bonds")
"""``CompressionConfig.recompute`` settings: None (autograd keeps what it keeps) or
``"bonds"`` (each block keeps its input and its layers' bonds, ``compile.bond_recompute``)."""

HOST_MEMORY_MODES = ("off", "cache", "reuse", "release")
"""``host_memory`` settings: ``"off"`` (the default) changes nothing; the others are
process-wide (``comera_compile.compile.host_memory``)."""

MEMORY_BUDGETS = {"default": 1.0, "low": 0.999}
"""``memory`` settings as AOT autograd activation budgets. Any budget below 1 recomputes
the outputs of thin (rank-bond) matmuls of 4 MiB or more and what is computed from them
alone (``compile.recompute``) and lets the min-cut recompute long fusible chains; "low" stops
there (0.999 asks AOT autograd for nothing more). Lower budgets also recompute, by AOT
autograd's flop-priced knapsack, layer norms, attention and the rest of each layer."""


def parse_memory(memory: str | float) -> float:
    """The activation budget of a ``memory`` setting (a name or a fraction in ``(0, 1]``)."""
    if isinstance(memory, str):
        if memory not in MEMORY_BUDGETS:
            raise ValueError(
                f"comera option 'memory' must be one of {list(MEMORY_BUDGETS)} or a fraction "
                f"in (0, 1], got {memory!r}"
            )
        return MEMORY_BUDGETS[memory]
    if isinstance(memory, bool) or not isinstance(memory, (int, float)) or not 0 < memory <= 1:
        raise ValueError(f"comera option 'memory' as a number must lie in (0, 1], got {memory!r}")
    return float(memory)


def check_host_memory(host_memory: object) -> str:
    """``host_memory`` as one of :data:`HOST_MEMORY_MODES` (None reads as ``"off"``)."""
    host_memory = "off" if host_memory is None else host_memory
    if host_memory not in HOST_MEMORY_MODES:
        raise ValueError(
            f"comera option 'host_memory' must be one of {list(HOST_MEMORY_MODES)} or None, "
            f"got {host_memory!r}"
        )
    return host_memory


def _flag(name: str, value: Any, allow_none: bool = True) -> bool | None:
    if value is None and allow_none:
        return None
    if not isinstance(value, bool):
        raise TypeError(f"comera option {name!r} must be a bool, got {value!r}")
    return value


def _jsonable(value: Any) -> Any:
    """``value`` with tuples as lists and numpy / torch scalars as Python numbers."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "item"):  # a numpy or torch scalar
        return value.item()
    raise TypeError(f"a configuration value must be JSON-able, got {value!r}")


def _from_dict(cls, data: dict[str, Any]):
    if not isinstance(data, dict):
        raise TypeError(f"{cls.__name__}.from_dict takes a dict, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields {unknown}; its fields are "
                         f"{sorted(names)}")
    return cls(**data)


@dataclass
class CompileOptions:
    """Options of the ``comera`` torch.compile backend (``compile_model(model, options)``,
    ``CompressionConfig.compile_options``, or as a dict,
    ``torch.compile(model, backend="comera", options=opts.to_backend_options())``).

    ``memory``: ``"default"``, ``"low"`` (recompute the wide outputs of thin products in
    backward: less training memory for more step time) or a budget in ``(0, 1]``, AOT
    autograd's fraction of activations kept (lower: more recomputed).
    ``host_memory``: ``"off"`` (the default) leaves torch's CPU allocator and glibc's
    ``malloc`` settings alone; ``"cache"``, ``"reuse"`` and ``"release"`` change them for the
    whole process (``comera_compile.compile.host_memory``: faster CPU steps for more
    resident memory, or the reverse). The first compile that asks for a mode sets it; a
    later one asking for another warns and leaves it.
    ``cudagraphs``: run under CUDA Graph trees (None: on when the graph runs on CUDA).
    ``autotune`` / ``objective``: override the layers' plan settings for this graph (None:
    keep each layer's). ``inductor``: False stops after AOT autograd (eager kernels).
    ``absorb_attention``: compute attentions whose Q, K, V and O are TT, low-rank or CoLA
    layers through their rank bonds where that costs fewer flops.
    ``join_products``: compute thin products of one activation by several weights (CoLA's
    Q, K, V or gate and up factors) as one wider product.
    ``inductor_config``: ``torch._inductor.config`` entries to patch while compiling
    (checked against inductor's config when the model is compiled).
    ``blocks``: compile the model's repeated blocks, one graph for blocks of equal shapes,
    rather than the whole model (``comera_compile.compile.blocks``; None: where each graph
    would serve three blocks or more; True: required; False: the whole model).
    ``symbolic_ranks``: True keeps the TT layers' rank bonds symbolic in the compiled
    graphs, so rank cuts and blocks of different ranks need no new graph
    (``comera_compile.compile.rank_dims``; steps run a little slower); False: graphs
    specialised to today's ranks (each cut recompiles); None: symbolic where ``optimize``'s
    measured compile learns that the run cuts ranks (a rank trainer that prunes), else
    static.
    Neither is a backend option: ``torch.compile(model, backend="comera")`` compiles what
    it is given, at static ranks.
    """

    memory: str | float = "default"
    host_memory: str = "off"
    cudagraphs: bool | None = None
    autotune: bool | None = None
    objective: str | None = None
    inductor: bool = True
    absorb_attention: bool = True
    join_products: bool = True
    inductor_config: dict[str, Any] = field(default_factory=dict)
    blocks: bool | None = None
    symbolic_ranks: bool | None = None

    def __post_init__(self) -> None:
        parse_memory(self.memory)
        self.host_memory = check_host_memory(self.host_memory)
        _flag("cudagraphs", self.cudagraphs)
        _flag("autotune", self.autotune)
        _flag("inductor", self.inductor, allow_none=False)
        _flag("absorb_attention", self.absorb_attention, allow_none=False)
        _flag("join_products", self.join_products, allow_none=False)
        _flag("blocks", self.blocks)
        _flag("symbolic_ranks", self.symbolic_ranks)
        if self.objective is not None:
            if not isinstance(self.objective, str):
                raise TypeError(f"comera option 'objective' must be a str, got "
                                f"{self.objective!r}")
            parse_objective(self.objective)  # raises with the valid names
        if not isinstance(self.inductor_config, dict):
            raise TypeError("CompileOptions.inductor_config must be a dict of "
                            f"torch._inductor.config entries, got {self.inductor_config!r}")

    def to_backend_options(self) -> dict[str, Any]:
        """The backend's ``options`` dict (settings left at their defaults are left out)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name in ("inductor_config", "blocks", "symbolic_ranks"):  # not the backend's
                continue
            value = getattr(self, f.name)
            default = f.default
            if value != default:
                out[f.name] = value
        out.update(self.inductor_config)
        return out

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-able."""
        return _jsonable(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CompileOptions:
        """The options ``to_dict`` wrote (unknown fields are refused by name)."""
        return _from_dict(cls, data)


def _budget_to_json(budget: object) -> object:
    if isinstance(budget, Budget):
        return {"Budget": {k: v for k, v in dataclasses.asdict(budget).items() if v is not None}}
    return budget


def _budget_from_json(budget: object) -> object:
    if isinstance(budget, dict) and set(budget) == {"Budget"}:
        return Budget(**budget["Budget"])
    return budget


@dataclass
class CompressionConfig:
    """What ``optimize`` does to a model, as one object (``cc.optimize(model, config)``;
    ``optimize``'s keyword arguments build one).

    ``budget``: how small the result must be (module docstring: a float keeps a share, a
    ``"40x"`` string or ``Budget(ratio=40)`` is a compression ratio, an int a parameter
    count; None tensorizes every eligible layer at the default rank).
    ``format``: ``"tt"``, ``"ttm"``, ``"lowrank"``, ``"cola"``, ``"auto"`` (per layer, by
    output error; pretrained weights) or None (from scratch ``"cola"``, or ``"tt"`` where the
    budget is below CoLA's rank-1 floor; ``"auto"`` for ``init="dense"`` with example
    inputs; else ``"tt"``). ``init``: ``"random"``
    (train from scratch, as CoMERA does) or ``"dense"`` (TT-SVD of the current weights).
    ``max_rank``: a cap on every bond rank. ``include`` / ``exclude``: layer names or
    glob patterns to consider or leave dense. ``layer_config``: per-layer settings by name.
    ``objective``: the planner's cost (cotengra's ``"combo"``); ``autotune``: time the best
    few contraction orders of each layer on first use. ``fuse``: merge sibling Linear
    layers that read the same input first. ``device``: where new cores are created.
    ``compile``: compile the result with the ``comera`` backend, with ``compile_options``
    (``True``: then time the first training and inference steps compiled against eager and
    keep the faster, so compiling never leaves a model slower; ``"always"``: keep it
    compiled without timing; ``False``: eager).
    ``recompute``: ``"bonds"`` runs each block of the model's stacks (a transformer's layers)
    under a checkpoint that keeps only the block's input and its CoLA layers' rank-wide bonds
    and recomputes the rest of the block in backward, as CoLA-M does (less training memory
    for about one more forward of each block's wide half; ``compile.bond_recompute``); None
    keeps what autograd keeps.
    """

    budget: float | int | str | Budget | None = None
    format: str | None = None
    init: str = "random"
    max_rank: int | None = None
    include: str | list[str] | None = None
    exclude: str | list[str] | None = None
    layer_config: dict[str, dict[str, Any]] | None = None
    objective: str = "combo"
    autotune: bool = False
    fuse: bool = False
    device: str = "cpu"
    compile: bool | str = True
    compile_options: CompileOptions = field(default_factory=CompileOptions)
    recompute: str | None = None

    def __post_init__(self) -> None:
        check_init(self.init)
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be one of {list(RECOMPUTE_MODES)}, got "
                             f"{self.recompute!r}")
        if self.format not in (None, AUTO):
            check_format(self.format)
        if self.max_rank is not None:
            positive_int("max_rank", self.max_rank)
        parse_objective(self.objective)
        parse_budget(self.budget)  # a bad budget fails here, with the accepted forms
        check_layer_config(self.layer_config)
        _flag("autotune", self.autotune, allow_none=False)
        _flag("fuse", self.fuse, allow_none=False)
        if not (isinstance(self.compile, bool) or self.compile == "always"):
            raise ValueError(f"compile must be True, False or 'always', got {self.compile!r}")
        self.device = str(self.device)
        if isinstance(self.compile_options, dict):
            self.compile_options = CompileOptions.from_dict(self.compile_options)
        if not isinstance(self.compile_options, CompileOptions):
            raise TypeError("CompressionConfig.compile_options must be a CompileOptions (or "
                            f"its dict), got {type(self.compile_options).__name__}")
        if not self.compile:
            opts = self.compile_options
            if opts.memory != "default":
                raise ValueError(f"memory={opts.memory!r} acts while compiling; pass "
                                 "compile=True")
            if opts.host_memory != "off":
                raise ValueError(f"host_memory={opts.host_memory!r} acts while compiling; "
                                 "pass compile=True")

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-able (a ``Budget`` as ``{"Budget": {...}}``)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["budget"] = _budget_to_json(self.budget)
        out["compile_options"] = self.compile_options.to_dict()
        return _jsonable(out)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CompressionConfig:
        """The configuration ``to_dict`` wrote (unknown fields are refused by name)."""
        data = dict(data) if isinstance(data, dict) else data
        if isinstance(data, dict) and "budget" in data:
            data["budget"] = _budget_from_json(data["budget"])
        return _from_dict(cls, data)


def config_of(model: Any) -> CompressionConfig | None:
    """The :class:`CompressionConfig` ``optimize`` ran with on ``model`` (also on a model
    ``load`` returned: the checkpoint keeps it); None for a model ``optimize`` never saw."""
    report = report_of(model)
    data = getattr(report, "config", None)
    return None if data is None else CompressionConfig.from_dict(data)
