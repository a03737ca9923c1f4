"""The two configuration objects: :class:`CompressionConfig` for ``optimize`` and
:class:`CompileOptions` for the ``comera`` backend.

Both are dataclasses checked when built (a bad value fails at once, naming the accepted
values) and turn into JSON-able dicts and back (``to_dict`` / ``from_dict``), so ``save``
writes the configuration ``optimize`` ran with and :func:`config_of` reads it back::

    config = cc.CompressionConfig(budget="40x", format="tt", max_rank=16,
                                  compile_options=cc.CompileOptions(memory="low"))
    model = cc.optimize(model, config)
    cc.config_of(model) == config          # also after save / load

Budget forms: docs/budgets.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from comera_compile.formats import positive_int
from comera_compile.nn.row_cache import DEFAULT_WARMUP
from comera_compile.passes import Budget, check_format, check_init, parse_budget
from comera_compile.passes.choose import AUTO
from comera_compile.passes.report import report_of
from comera_compile.passes.targets import check_layer_config
from comera_compile.planner import parse_objective

RECOMPUTE_MODES = (None, "bonds", "auto")
"""``CompressionConfig.recompute`` settings: None (autograd keeps what it keeps),
``"bonds"`` (each block keeps its input and its layers' bonds, ``compile.bond_recompute``)
or ``"auto"`` (bonds where the example batch's activations outweigh the parameter state)."""

HOST_MEMORY_MODES = ("off", "cache", "reuse", "release")
"""``host_memory`` settings: ``"off"`` (the default) changes nothing; the others are
process-wide (``comera_compile.compile.cpu.host_memory``)."""

LOW_MEMORY = 0.999
"""The activation budget ``memory="low"`` stands for. Any budget below 1 recomputes the
outputs of thin (rank-bond) matmuls of 4 MiB or more and what is computed from them alone
(``compile.graph.recompute``) and lets the min-cut recompute long fusible chains; 0.999
stops there, asking AOT autograd's flop-priced knapsack for nothing more. Lower budgets
also recompute layer norms, attention and the rest of each layer."""

ACTIVATION_BUDGETS = {"default": 1.0, "low": LOW_MEMORY}
"""``memory`` settings by name, as AOT autograd activation budgets (the fraction of
activations kept for backward)."""

RUNTIME = {"runtime": True}
"""Field metadata of settings that act on this process only (process-wide allocator modes,
a Python callable): they are not written into the saved configuration."""

BACKEND_KEYS = (
    "cudagraphs", "autotune", "objective", "inductor", "memory", "host_memory",
    "absorb_attention", "join_products", "pooled_kernels", "dtype_rules_once",
)
"""The ``CompileOptions`` fields the backend's ``options`` dict takes by name; any other
key of that dict is a ``torch._inductor.config`` entry."""


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


def _saved_fields(obj: Any) -> dict[str, Any]:
    """The fields of a config dataclass that a checkpoint keeps (runtime ones left out)."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)
            if not f.metadata.get("runtime")}


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
    """Options of the ``comera`` torch.compile backend, one object for every way in:
    ``CompressionConfig.compile_options``, ``compile_model(model, options)``, and
    ``torch.compile(model, backend="comera", options=opts.to_backend_options())`` (the dict
    form: the fields of :data:`BACKEND_KEYS` by name, any other key an inductor entry).

    ``memory``: ``"default"``, ``"low"`` (recompute the wide outputs of thin products in
    backward: less training memory for more step time; :data:`LOW_MEMORY`) or a budget in
    ``(0, 1]``, AOT autograd's fraction of activations kept (lower: more recomputed).
    ``host_memory`` (CPU, runtime only: not saved): ``"off"`` (the default) leaves torch's
    CPU allocator and glibc's ``malloc`` settings alone; ``"cache"``, ``"reuse"`` and
    ``"release"`` change them for the whole process (``comera_compile.compile.cpu.host_memory``:
    faster CPU steps for more resident memory, or the reverse). The first compile that asks
    for a mode sets it; a later one asking for another warns and leaves it. Where the block
    cache of ``"cache"`` cannot be built, the backend falls back to ``"reuse"`` at the
    default memory budget and to ``"release"`` below it.
    ``cudagraphs``: run under CUDA Graph trees (None: on when the graph runs on CUDA).
    ``autotune`` / ``objective``: override the layers' plan settings for this graph (None:
    keep each layer's). ``inductor``: False stops after AOT autograd (eager kernels).
    ``absorb_attention``: compute attentions whose Q, K, V and O are TT, low-rank or CoLA
    layers through their rank bonds where that costs fewer flops.
    ``join_products``: compute thin products of one activation by several weights (CoLA's
    Q, K, V or gate and up factors) as one wider product.
    ``pooled_kernels`` (CPU): build a generated module's kernels in one compiler run per
    compile worker (``compile.cpu.pooled_kernels``); False: one run per kernel, as inductor.
    ``dtype_rules_once``: build inductor's dtype rule table once per compile, not once per
    generated op (``compile.cpu.dtype_rules``); False: inductor as it is.
    ``inductor_config``: ``torch._inductor.config`` entries to patch while compiling
    (checked against inductor's config when the model is compiled).
    ``blocks``: compile the model's repeated blocks, one graph for blocks of equal shapes,
    rather than the whole model (``comera_compile.compile.policy.blocks``; None: where each
    graph would serve three blocks or more; True: required; False: the whole model).
    ``symbolic_ranks``: True keeps the TT layers' rank bonds symbolic in the compiled
    graphs, so rank cuts and blocks of different ranks need no new graph
    (``comera_compile.compile.policy.rank_dims``; steps run a little slower); False: graphs
    specialised to today's ranks (each cut recompiles); None: symbolic where ``optimize``'s
    measured compile learns that the run cuts ranks (a rank trainer that prunes), else
    static. Neither of these two is a backend option: ``torch.compile(model,
    backend="comera")`` compiles what it is given, at static ranks.
    """

    memory: str | float = "default"
    host_memory: str = field(default="off", metadata=RUNTIME)
    cudagraphs: bool | None = None
    autotune: bool | None = None
    objective: str | None = None
    inductor: bool = True
    absorb_attention: bool = True
    join_products: bool = True
    pooled_kernels: bool = True
    dtype_rules_once: bool = True
    inductor_config: dict[str, Any] = field(default_factory=dict)
    blocks: bool | None = None
    symbolic_ranks: bool | None = None

    def __post_init__(self) -> None:
        self.activation_budget  # noqa: B018 - checks memory, with the accepted values
        self.host_memory = "off" if self.host_memory is None else self.host_memory
        if self.host_memory not in HOST_MEMORY_MODES:
            raise ValueError(f"comera option 'host_memory' must be one of "
                             f"{list(HOST_MEMORY_MODES)} or None, got {self.host_memory!r}")
        for name in ("cudagraphs", "autotune", "blocks", "symbolic_ranks"):
            _flag(name, getattr(self, name))
        for name in ("inductor", "absorb_attention", "join_products", "pooled_kernels",
                     "dtype_rules_once"):
            _flag(name, getattr(self, name), allow_none=False)
        if self.objective is not None:
            if not isinstance(self.objective, str):
                raise TypeError(f"comera option 'objective' must be a str, got "
                                f"{self.objective!r}")
            parse_objective(self.objective)  # raises with the valid names
        if not isinstance(self.inductor_config, dict):
            raise TypeError("CompileOptions.inductor_config must be a dict of "
                            f"torch._inductor.config entries, got {self.inductor_config!r}")

    @property
    def activation_budget(self) -> float:
        """``memory`` as AOT autograd's activation budget (a name or a fraction in (0, 1])."""
        memory = self.memory
        if isinstance(memory, str):
            if memory not in ACTIVATION_BUDGETS:
                raise ValueError(f"comera option 'memory' must be one of "
                                 f"{list(ACTIVATION_BUDGETS)} or a fraction in (0, 1], got "
                                 f"{memory!r}")
            return ACTIVATION_BUDGETS[memory]
        if isinstance(memory, bool) or not isinstance(memory, (int, float)) or not 0 < memory <= 1:
            raise ValueError(f"comera option 'memory' as a number must lie in (0, 1], got "
                             f"{memory!r}")
        return float(memory)

    @property
    def low_memory(self) -> bool:
        """Whether backward recomputes activations (a budget below 1)."""
        return self.activation_budget < 1

    def to_backend_options(self) -> dict[str, Any]:
        """The backend's ``options`` dict (settings left at their defaults are left out)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name in BACKEND_KEYS and getattr(self, f.name) != f.default}
        out.update(self.inductor_config)
        return out

    @classmethod
    def from_backend_options(cls, options: dict[str, Any] | CompileOptions | None,
                             mode: str | None = None) -> CompileOptions:
        """The options the backend got (``torch.compile``'s ``options`` dict, or a
        ``CompileOptions``, and its ``mode``), every inductor entry checked against
        inductor's config."""
        import torch._inductor
        import torch._inductor.config as inductor_config

        if isinstance(options, CompileOptions):
            options = options.to_backend_options()
        options = dict(options or {})
        own = {name: options.pop(name) for name in BACKEND_KEYS if name in options}
        config = dict(torch._inductor.list_mode_options(mode)) if mode else {}
        mode_cudagraphs = config.pop("triton.cudagraphs", None)  # decided per graph
        if own.get("cudagraphs") is None and mode_cudagraphs is not None:
            own["cudagraphs"] = bool(mode_cudagraphs)
        known = set(inductor_config.get_config_copy())
        unknown = sorted(k for k in options if k not in known)
        if unknown:
            raise ValueError(
                f"unknown comera backend options {unknown}; the backend's own options are "
                f"{list(BACKEND_KEYS)}, and any other key must be a torch._inductor.config "
                "entry")
        return cls(**own, inductor_config={**config, **options})

    def to_dict(self) -> dict[str, Any]:
        """Every field but the runtime ones (``host_memory``), JSON-able."""
        return _jsonable(_saved_fields(self))

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
    """What ``optimize`` does to a model, as one object: ``cc.optimize(model, config)``.
    Every setting and its default lives here; ``optimize``'s keywords ``budget``,
    ``format``, ``init`` and ``compile`` are shortcuts over these fields.

    ``budget``: how small the result must be (module docstring: a float keeps a share, a
    ``"40x"`` string or ``Budget(ratio=40)`` is a compression ratio, an int a parameter
    count; None tensorizes every eligible layer at the default rank).
    ``format``: ``"cola"`` (``silu(x U) V``, the format that pays in pretraining), ``"tt"``
    (each layer's order, i.e. modes per side, is the one with the cheapest planned training step
    at the example batch, at equal parameters; ``layer_config`` can set ``order``), ``"ttm"``,
    ``"lowrank"`` (``W = U V``: fastest per row, least accurate at high compression), ``"btt"``
    (block tensor-train: full rank, a rank gate), ``"monarch"`` (full rank, sized by its block
    count), ``"auto"`` (with ``init="dense"`` and example inputs: the layers are sized in low
    rank, then each Linear layer gets the format of least output error at that size, and the
    summary says why; without inputs low rank) or None (from scratch ``"cola"``, or ``"tt"``
    where the budget is below CoLA's rank-1 floor; ``"auto"`` for ``init="dense"`` with example
    inputs; else ``"tt"``). A format you name is kept.
    ``init``: ``"random"`` (train from scratch, as CoMERA does) or ``"dense"`` (TT-SVD of
    the current weights, for pretrained models). A model built under
    ``torch.device("meta")`` takes ``init="random"``: cores are created on ``device`` and
    only the rest of the model is allocated there, so no dense weight of a swapped layer
    ever exists.
    ``max_rank``: a cap on every bond rank. ``include`` / ``exclude``: layer names or glob
    patterns to consider or leave dense. ``filter_fn(module, name)``: False leaves a layer
    dense (runtime only: not saved). ``layer_config``: per-layer settings by name
    (``format``, ``ranks``, modes, ``order``; ``blocks`` for a Monarch layer).
    ``objective``: the planner's cost (cotengra's ``"combo"``); ``autotune``: time the best
    few contraction orders of each layer on first use. ``fuse``: merge sibling Linear
    layers that read the same input (Q/K/V, gate/up) first, so they tensorize into one
    chain; the forward changes, so ``optimize`` then returns the fused
    ``torch.fx.GraphModule`` (the model must trace exactly). ``device``: where new cores
    are created.
    ``compile``: compile the result in place with the ``comera`` backend and
    ``compile_options`` (``True``: eager until eager calls have taken as long as the best
    compiled step would need to repay a first compile, then the first training and
    inference steps timed compiled against eager and the faster kept, so compiling never
    leaves a model slower, ``compile.policy.measured``; ``"always"``: compiled at once,
    without timing; ``False``: eager).
    ``row_cache``: the share of a recommender table's parameters (a bag or a ``sparse=True``
    table) spent on a hot-row cache (``passes.row_cache``): ``"auto"`` gives one where the
    example ids are skewed enough to pay and none where they are close to uniform, a number
    in ``[0, 1)`` that share to every such table (0: none). ``cache_warmup``: training
    batches whose ids are counted before each cache's rows are chosen and fixed.
    ``recompute``: ``"bonds"`` runs each block of the model's stacks (a transformer's layers)
    under a checkpoint that keeps only the block's input and its CoLA layers' rank-wide bonds
    and recomputes the rest of the block in backward, as CoLA-M does (less training memory
    for about one more forward of each block's wide half; ``compile.bond_recompute``); None
    keeps what autograd keeps; ``"auto"`` (the default) recomputes where it pays: in a model
    with CoLA layers in its stacks whose training step on ``example_inputs`` keeps more for
    backward than its weights, gradients and AdamW moments weigh (without example inputs:
    None). A Hugging Face causal LM's loss keeps no copy of the logits either way
    (``training.causal_loss``).
    """

    budget: float | int | str | Budget | None = None
    format: str | None = None
    init: str = "random"
    max_rank: int | None = None
    include: str | list[str] | None = None
    exclude: str | list[str] | None = None
    filter_fn: Callable[[Any, str], bool] | None = field(default=None, metadata=RUNTIME,
                                                         compare=False)
    layer_config: dict[str, dict[str, Any]] | None = None
    objective: str = "combo"
    autotune: bool = False
    fuse: bool = False
    device: str = "cpu"
    compile: bool | str = True
    compile_options: CompileOptions = field(default_factory=CompileOptions)
    row_cache: float | str = "auto"
    cache_warmup: int = DEFAULT_WARMUP
    recompute: str | None = "auto"

    def __post_init__(self) -> None:
        check_init(self.init)
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be one of {list(RECOMPUTE_MODES)}, got "
                             f"{self.recompute!r}")
        if self.row_cache != "auto" and (
                isinstance(self.row_cache, bool) or not isinstance(self.row_cache, (int, float))
                or not 0 <= self.row_cache < 1):
            raise ValueError(f"row_cache must be 'auto' or a share in [0, 1), got "
                             f"{self.row_cache!r}")
        if (isinstance(self.cache_warmup, bool) or not isinstance(self.cache_warmup, int)
                or self.cache_warmup < 0):
            raise ValueError(f"cache_warmup must be a non-negative int, got {self.cache_warmup!r}")
        if self.format not in (None, AUTO):
            check_format(self.format)
        if self.max_rank is not None:
            positive_int("max_rank", self.max_rank)
        parse_objective(self.objective)
        parse_budget(self.budget)  # a bad budget fails here, with the accepted forms
        check_layer_config(self.layer_config)
        if self.filter_fn is not None and not callable(self.filter_fn):
            raise TypeError(f"filter_fn must be a callable (module, name) -> bool, got "
                            f"{self.filter_fn!r}")
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
            for name, default in (("memory", "default"), ("host_memory", "off")):
                if getattr(opts, name) != default:
                    raise ValueError(f"{name}={getattr(opts, name)!r} acts while compiling; "
                                     "pass compile=True")

    def to_dict(self) -> dict[str, Any]:
        """Every field but the runtime ones, JSON-able (a ``Budget`` as ``{"Budget": {...}}``)."""
        out = _saved_fields(self)
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
