"""The two configuration objects: :class:`CompressionConfig` for ``optimize`` and
:class:`CompileOptions` for the ``comera`` backend. Both are checked when built and round-trip
through JSON, so ``save`` keeps the configuration and :func:`config_of` reads it back::

    model = cc.optimize(model, cc.CompressionConfig(budget="40x", format="tt"))
    cc.config_of(model)                    # the same config, also after save / load
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

HOST_MEMORY_MODES = ("auto", "off", "cache", "reuse", "release")
"""``host_memory`` settings: ``"auto"`` (the default): the block cache, process-wide, once
``optimize`` has a CPU model recompute its bonds, else nothing; ``"off"`` changes nothing;
the others are process-wide (``comera_compile.compile.cpu.host_memory``)."""

LOW_MEMORY = 0.999
"""The activation budget ``memory="low"`` stands for: any budget below 1 recomputes wide
thin-product outputs (``compile.graph.recompute``), and 0.999 asks AOT autograd's knapsack
for nothing more (lower budgets also recompute norms, attention and the rest)."""

ACTIVATION_BUDGETS = {"default": 1.0, "low": LOW_MEMORY}
"""``memory`` settings by name, as AOT autograd activation budgets (the fraction of
activations kept for backward)."""

RUNTIME = {"runtime": True}
"""Field metadata of settings that act on this process only (process-wide allocator modes,
a Python callable): they are not written into the saved configuration."""

BACKEND_KEYS = ("cudagraphs", "autotune", "objective", "inductor", "memory", "host_memory",
                "absorb_attention", "join_products", "pooled_kernels", "dtype_rules_once")
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
    backward: less memory for more step time; :data:`LOW_MEMORY`) or AOT autograd's
    fraction of activations kept, in ``(0, 1]``.
    ``host_memory`` (CPU, runtime only): ``"auto"``: ``optimize`` sets ``"cache"`` for the
    process when it has a CPU model recompute its bonds (a step's transients then outweigh
    what it keeps, and glibc's heap fragments under them), else as ``"off"``; ``"off"``
    leaves the allocators alone; ``"cache"``, ``"reuse"`` and ``"release"`` change them for
    the whole process (``compile.cpu.host_memory``); the first compile that asks sets the
    mode.
    ``cudagraphs``: run under CUDA Graph trees (None: on CUDA). ``autotune`` /
    ``objective``: override the layers' plan settings (None: keep each layer's).
    ``inductor``: False stops after AOT autograd. ``absorb_attention``: attention through
    the rank bonds where that costs fewer flops. ``join_products``: thin products of one
    activation joined into one. ``pooled_kernels`` (CPU): one compiler run per worker.
    ``dtype_rules_once``: inductor's dtype rule table built once per compile.
    ``inductor_config``: ``torch._inductor.config`` entries patched while compiling.
    ``blocks``: compile the repeated blocks, one graph per shape (``compile.policy.blocks``;
    None: where a graph serves three blocks or more; True: required; False: whole model).
    ``symbolic_ranks``: keep rank bonds symbolic so cuts compile nothing
    (``compile.policy.rank_dims``; slower steps); None: where the run cuts ranks. These two
    are not backend options: ``torch.compile(model, backend="comera")`` compiles what it is
    given, at static ranks.
    """

    memory: str | float = "default"
    host_memory: str = field(default="auto", metadata=RUNTIME)
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

    ``budget``: how small the result must be (a float keeps a share, ``"40x"`` or
    ``Budget(ratio=40)`` is a compression ratio, an int a parameter count: docs/budgets.md;
    None tensorizes every eligible layer at the default rank).
    ``format``: ``"cola"`` (``silu(x U) V``, the format that pays in pretraining), ``"tt"``
    (each layer's order the one of cheapest planned training step at equal parameters),
    ``"ttm"``, ``"lowrank"``, ``"btt"``, ``"monarch"``, ``"auto"`` (with ``init="dense"`` and
    example inputs: each Linear gets the format of least output error at its low-rank size)
    or None (from scratch ``"cola"``, or ``"tt"`` below CoLA's rank-1 floor; ``"auto"`` for
    ``init="dense"`` with example inputs; else ``"tt"``). A format you name is kept.
    ``init``: ``"random"`` (train from scratch) or ``"dense"`` (decompose the current weights).
    A model built under ``torch.device("meta")`` takes ``"random"`` and no dense weight of a
    swapped layer ever exists.
    ``max_rank``: a cap on every bond rank. ``include`` / ``exclude``: layer names or glob
    patterns. ``filter_fn(module, name)``: False leaves a layer dense (runtime only).
    ``layer_config``: per-layer settings by name (``format``, ``ranks``, modes, ``order``,
    ``blocks``). ``objective`` / ``autotune``: the planner's cost and whether to time the
    best few orders. ``fuse``: merge sibling Linear layers that read the same input first
    (``optimize`` then returns the fused ``GraphModule``). ``device``: where cores are made.
    ``compile``: ``True`` compiles with ``compile_options`` and keeps the compiled form only
    where timed steps show it faster (``compile.policy.measured``); ``"always"`` compiles
    without timing; ``False`` stays eager.
    ``row_cache``: the share of a recommender table spent on a hot-row cache (``"auto"``:
    where the example ids are skewed enough to pay); ``cache_warmup``: training batches
    counted before the cached rows are fixed.
    ``recompute``: ``"bonds"`` checkpoints each block keeping only its input and its CoLA
    layers' rank-wide bonds (``compile.bond_recompute``); ``"auto"`` does so where the
    example step keeps more for backward than the weights and AdamW state weigh; None
    keeps what autograd keeps.
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
            for name, defaults in (("memory", ("default",)), ("host_memory", ("auto", "off"))):
                if getattr(opts, name) not in defaults:
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
