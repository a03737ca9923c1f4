"""Options of the ``comera`` backend, checked at the door.

``torch.compile(model, backend="comera", options={...})`` passes the dict here. Our own keys
are popped; every other key must be an inductor config entry and is forwarded to it, so
one options dict serves both layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch._inductor.config as inductor_config

from comera_compile.config import (
    HOST_MEMORY_MODES,
    MEMORY_BUDGETS,  # noqa: F401 - re-exported
    CompileOptions,
    _flag,
    check_host_memory,
    parse_memory,
)
from comera_compile.planner import parse_objective

OWN_KEYS = (
    "cudagraphs", "autotune", "objective", "inductor", "memory", "host_memory",
    "absorb_attention", "join_products",
)

HOST_MEMORY = HOST_MEMORY_MODES


@dataclass
class BackendOptions:
    """``cudagraphs``: run under CUDA Graph trees (None: on when the graph runs on CUDA).
    ``autotune`` / ``objective``: override the layers' plan settings for this graph (None:
    keep each layer's). ``inductor``: False stops after AOT autograd (eager kernels; for
    debugging a numerical difference). ``memory``: ``"default"``, ``"low"`` (recompute the wide
    outputs of thin products in backward: less training memory for more step time;
    ``python benchmarks/step.py`` measures both) or a budget in ``(0, 1]``, AOT
    autograd's fraction of activations kept (any budget below 1 recomputes thin products too).
    ``host_memory``: ``"off"`` (the default; None means the same) leaves torch's CPU
    allocator and glibc's ``malloc`` settings alone. The others change the whole process,
    not only this model (``compile.cpu.host_memory``): ``"cache"`` keeps freed blocks of 1 MiB
    or more by size for the next request of that size (a C++ allocator installed as
    torch's CPU allocator), ``"reuse"`` keeps freed blocks in glibc's heap (both: each
    step's large activations are not mapped and faulted in anew, for more resident
    memory), ``"release"`` hands every freed block of 128 KiB or more back to the OS at
    once (the least resident memory, a page fault per page touched). The first compile
    that asks for a mode sets it; a later one asking for another warns and leaves it.
    ``absorb_attention``: compute attentions whose Q, K, V and O are TT, low-rank or CoLA
    layers through their rank bonds where that costs fewer flops
    (``compile.graph.absorbed_attention``; default on).
    ``join_products``: compute thin products of one activation by several weights (CoLA's
    Q, K, V or gate and up factors) as one product (``compile.graph.sibling_matmuls``; default on).
    ``config``: inductor config patches."""

    cudagraphs: bool | None = None
    autotune: bool | None = None
    objective: str | None = None
    inductor: bool = True
    memory: float = 1.0
    host_memory: str = "off"
    absorb_attention: bool = True
    join_products: bool = True
    config: dict[str, Any] = field(default_factory=dict)


def parse_options(options: dict[str, Any] | CompileOptions | None,
                  mode: str | None = None) -> BackendOptions:
    """Validate ``options`` (a dict or :class:`~comera_compile.config.CompileOptions`, and
    torch.compile's ``mode``) into :class:`BackendOptions`."""
    if isinstance(options, CompileOptions):
        options = options.to_backend_options()
    options = dict(options or {})
    out = BackendOptions(
        cudagraphs=_flag("cudagraphs", options.pop("cudagraphs", None)),
        autotune=_flag("autotune", options.pop("autotune", None)),
        inductor=bool(_flag("inductor", options.pop("inductor", True), allow_none=False)),
        absorb_attention=bool(_flag(
            "absorb_attention", options.pop("absorb_attention", True), allow_none=False)),
        join_products=bool(_flag(
            "join_products", options.pop("join_products", True), allow_none=False)),
    )
    out.memory = parse_memory(options.pop("memory", "default"))
    out.host_memory = check_host_memory(options.pop("host_memory", None))
    objective = options.pop("objective", None)
    if objective is not None:
        if not isinstance(objective, str):
            raise TypeError(f"comera option 'objective' must be a str, got {objective!r}")
        parse_objective(objective)  # raises with the valid names
        out.objective = objective
    config = dict(torch._inductor.list_mode_options(mode)) if mode else {}
    if "triton.cudagraphs" in config and out.cudagraphs is None:
        out.cudagraphs = bool(config["triton.cudagraphs"])
    config.pop("triton.cudagraphs", None)  # decided per graph, from the device
    known = set(inductor_config.get_config_copy())
    unknown = sorted(k for k in options if k not in known)
    if unknown:
        raise ValueError(
            f"unknown comera backend options {unknown}; the backend's own options are "
            f"{list(OWN_KEYS)}, and any other key must be a torch._inductor.config entry"
        )
    config.update(options)
    out.config = config
    return out
