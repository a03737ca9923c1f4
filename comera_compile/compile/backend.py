"""The ``comera`` torch.compile backend (registered as a ``torch_dynamo_backends`` entry point,
so ``torch.compile(model, backend="comera")`` works in a process that never imported us).
Each tensorized layer traces as one ``comera::`` op, keeping planning out of the trace; the
backend rewrites the graph (``compile.graph``, on CPU ``compile.cpu``) and hands it to inductor.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from comera_compile.compile.cpu import matmul_orientation, reductions
from comera_compile.compile.cpu.dropout import DropoutTag, hash_dropouts, may_drop_out
from comera_compile.compile.cpu.dropout import decompositions as dropout_decompositions
from comera_compile.compile.cpu.dtype_rules import dtype_rules_once
from comera_compile.compile.cpu.host_memory import (
    host_memory_mode,
    release_free_heap,
    set_host_memory,
)
from comera_compile.compile.cpu.pooled_kernels import pooled_kernels
from comera_compile.compile.graph.absorbed_attention import absorb_attention
from comera_compile.compile.graph.recompute import SaveRandomValues, partition_keeping_random
from comera_compile.compile.graph.sibling_matmuls import fuse_sibling_matmuls
from comera_compile.config import CompileOptions
from comera_compile.planner.ops import CONTRACT, TENSORIZED_OPS, row_bucket

log = logging.getLogger("comera_compile")
_graphs_compiled = 0
_warned_plain = False
_hinted_huge_pages = False


def tensorized_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The graph's tensorized contractions (one node per TT layer call)."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in TENSORIZED_OPS]


def _apply_plan_options(nodes: list[fx.Node], opts: CompileOptions) -> None:
    """Override the objective / autotune arguments of the contraction nodes in place (found
    by name in the op's schema)."""
    given = {"objective": opts.objective, "autotune": opts.autotune}
    given = {name: value for name, value in given.items() if value is not None}
    if not given:
        return
    position = {arg.name: i for i, arg in enumerate(CONTRACT._schema.arguments)}
    for node in nodes:
        if node.target is not CONTRACT:
            continue
        args = list(node.args)
        for name, value in given.items():
            args[position[name]] = value
        node.args = tuple(args)


def _warn_plain() -> None:
    global _warned_plain
    if _warned_plain:
        return
    _warned_plain = True
    warnings.warn("comera backend: this graph has no tensorized layer (TTLinear, TTMLinear, "
                  "LowRankLinear, CoLALinear, TTEmbedding), compiling it with plain inductor; use "
                  "comera_compile.optimize(model) to tensorize the model first", UserWarning,
                  stacklevel=2)


def _reads_cores(gm: fx.GraphModule) -> bool:
    """Whether the graph reads a tensorized layer's cores (a parameter list named ``cores``),
    as the low-rank and CoLA layers' plain matmuls do."""
    return any("cores" in node.name for node in gm.graph.nodes
               if node.op in ("placeholder", "get_attr"))


def _row_buckets(nodes: list[fx.Node]) -> str:
    """The plan buckets of the contractions' row counts, from the traced example values
    (a symbolic count is named as such: comparing it here would add a guard)."""
    buckets, dynamic = set(), False
    for node in nodes:
        x = node.args[0] if node.args else None
        value = x.meta.get("example_value") if isinstance(x, fx.Node) else None
        rows = value.shape[0] if isinstance(value, torch.Tensor) else None
        if isinstance(rows, int):
            buckets.add(row_bucket(rows))
        else:
            dynamic = True
    return ", ".join([str(b) for b in sorted(buckets)] + ["dynamic"] * dynamic)


def _log_start(nodes: list[fx.Node]) -> None:
    if nodes:
        log.info(
            "comera backend: compiling a graph with %d tensorized layer call(s), row bucket "
            "%s (the first call of each bucket takes a while)", len(nodes), _row_buckets(nodes)
        )
    else:
        log.info("comera backend: compiling a plain graph (the first call takes a while)")


_host_memory_request: dict[str, str | None] = {"mode": None}  # what a compile asked for
_host_memory_warned: set[tuple[str, str]] = set()


def _set_host_memory(opts: CompileOptions) -> None:
    """Apply ``host_memory`` when asked for (``"off"``, the default, changes nothing). The
    mode is process-wide: the first compile that asks for one sets it; a later compile
    asking for another warns once and leaves it. ``"cache"`` falls back, where the block
    cache cannot be built, to reuse at the default budget and release below it."""
    asked = "off" if opts.host_memory == "auto" else opts.host_memory  # "auto" is optimize's
    current = host_memory_mode()
    if current is None:  # nothing set in this process (or restore_host_memory since)
        _host_memory_request["mode"] = None
        if asked != "off":
            # no block cache: keep freed memory at the default budget, hand it back below
            fallback = "release" if opts.low_memory else "reuse"
            for mode in (asked,) if asked != "cache" else ("cache", fallback):
                if set_host_memory(mode):
                    _host_memory_request["mode"] = asked
                    break
    else:
        owner = _host_memory_request["mode"]
        if (owner is not None or asked != "off") and asked != (owner or current):
            _warn_host_memory(owner or current, asked)
    if opts.low_memory and host_memory_mode() == "release":
        _hint_huge_pages()


def _warn_host_memory(in_effect: str, asked: str) -> None:
    if (in_effect, asked) in _host_memory_warned:
        return
    _host_memory_warned.add((in_effect, asked))
    warnings.warn(
        f"comera backend: host memory is process-wide and host_memory={in_effect!r} is in "
        f"effect for every model in this process; this model's host_memory={asked!r} is not "
        "applied. Call comera_compile.compile.cpu.host_memory.set_host_memory(mode) or "
        "restore_host_memory() to change it for the whole process",
        UserWarning,
        stacklevel=3,
    )


def _hint_huge_pages() -> None:
    """Once per process: a low memory budget on CPU pays page faults that huge pages cut."""
    global _hinted_huge_pages
    if _hinted_huge_pages or os.environ.get("THP_MEM_ALLOC_ENABLE") == "1":
        return
    _hinted_huge_pages = True
    log.info("comera backend: memory='low' on CPU frees and maps its large activations every "
             "step; start the process with THP_MEM_ALLOC_ENABLE=1 (torch's huge pages) for fewer "
             "page faults")


def has_sparse_embedding(gm: fx.GraphModule) -> bool:
    """Whether the graph looks up an embedding with ``sparse=True`` (a table left dense):
    inductor cannot compile the backward of a sparse gradient (it reads tensor storages)."""
    lookups = (torch.nn.functional.embedding, torch.nn.functional.embedding_bag)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in lookups:
            bound = inspect.signature(node.target).bind(*node.args, **node.kwargs)
            if bound.arguments.get("sparse"):
                return True
    return False


def _on_cuda(example_inputs: Sequence[Any]) -> bool:
    return any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs)


def graphs_compiled() -> int:
    """How many graphs this backend has compiled in this process (each dynamo graph once;
    its forward and backward are one compile here): recompiles show up as growth."""
    return _graphs_compiled


def comera_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any):
    """Compile one dynamo graph: tune its tensorized contractions, then inductor."""
    global _graphs_compiled
    _graphs_compiled += 1
    opts = CompileOptions.from_backend_options(kwargs.get("options"), kwargs.get("mode"))
    nodes = tensorized_nodes(gm)
    reads_cores = bool(nodes) or _reads_cores(gm)  # CoLA layers are plain matmuls
    if nodes:
        _apply_plan_options(nodes, opts)
        gm.recompile()
    if reads_cores and opts.absorb_attention:
        absorb_attention(gm)
    if reads_cores and opts.join_products:
        fuse_sibling_matmuls(gm)
    if not reads_cores:
        _warn_plain()
    _log_start(nodes)
    cpu = not _on_cuda(example_inputs)
    if cpu:
        _set_host_memory(opts)
    # the partitioner reads the activation budget while the graph is compiled, right here
    with torch._functorch.config.patch(activation_memory_budget=opts.activation_budget):
        sparse = opts.inductor and has_sparse_embedding(gm)
        if sparse:
            log.info("comera backend: this graph looks up a sparse=True embedding table left "
                     "dense; inductor cannot compile sparse gradients, so it runs with AOT "
                     "autograd and eager kernels")
        if not opts.inductor or sparse:
            return _aot_eager(gm, example_inputs, low_memory=opts.low_memory)
        from torch._inductor.compile_fx import compile_fx

        cuda = _on_cuda(example_inputs)
        cudagraphs = opts.cudagraphs if opts.cudagraphs is not None else cuda
        config = {**opts.inductor_config, "triton.cudagraphs": bool(cudagraphs)}
        if "joint_custom_pre_pass" not in config and (opts.low_memory or not cuda):
            # the forward's dropout masks in backward; on CPU, hashed masks are recomputed,
            # and so are comparison masks (inductor's CPU kernels store booleans slowly)
            config["joint_custom_pre_pass"] = SaveRandomValues(low_memory=opts.low_memory,
                                                               cpu=not cuda)
        # On CPU, inductor's own dropout RNG is slower than aten's: aten's random numbers,
        # and dropout masks hashed from element indices (compile.cpu.dropout); its tag keys the
        # caches.
        config.setdefault("fallback_random", not cuda)
        decompositions = None
        if not cuda and "post_grad_custom_post_pass" not in config:
            config["post_grad_custom_post_pass"] = DropoutTag()
            hash_dropouts(gm)  # traced as hashed masks: no table needed for these
            if may_drop_out(gm):  # a table handed in keeps the graph out of inductor's cache
                decompositions = dropout_decompositions(config["fallback_random"])
        if not cuda:  # row sums in blocks (compile.cpu.reductions), thin matmuls turned around
            config.setdefault("post_grad_custom_pre_pass", CpuPostGradPasses())
        return compile_fx(gm, example_inputs, config_patches=config,
                          decompositions=decompositions,
                          inner_compile=_compile_then_release(cuda, opts))


class CpuPostGradPasses(CustomGraphPass):
    """Inductor's post-grad pass slot for CPU graphs: row sums in blocks
    (``compile.cpu.reductions``), then thin weight-gradient matmuls turned around
    (``compile.cpu.matmul_orientation``). Its uuid (both files' hashes) keys inductor's caches."""

    def __call__(self, graph: fx.Graph) -> None:
        reductions.split_row_sums(graph)
        matmul_orientation.orient_thin_matmuls(graph)

    def uuid(self) -> bytes:
        digest = hashlib.sha256()
        for module in (reductions, matmul_orientation):
            digest.update(Path(module.__file__).read_bytes())
        return digest.digest()


def _compile_then_release(cuda: bool, opts: CompileOptions):
    """Inductor's inner compile (called once for the forward, once for the backward); on
    CPU followed by :func:`release_free_heap`: compiling frees far more than it keeps, and
    with reuse on, the heap would hold it."""
    from torch._inductor.compile_fx import compile_fx_inner

    if cuda:
        def compile_with_rules_once(*args: Any, **kwargs: Any):
            with dtype_rules_once(opts.dtype_rules_once):
                return compile_fx_inner(*args, **kwargs)

        return compile_with_rules_once

    def compile_and_release(*args: Any, **kwargs: Any):
        # one compiler run per worker, not per kernel; dtype rules built once, not per op
        with pooled_kernels(opts.pooled_kernels), dtype_rules_once(opts.dtype_rules_once):
            compiled = compile_fx_inner(*args, **kwargs)
        release_free_heap()
        return compiled

    return compile_and_release


def _aot_eager(gm: fx.GraphModule, example_inputs: Sequence[Any], low_memory: bool):
    """AOT autograd with eager kernels; with the min-cut partitioner (inductor's) when a
    memory budget is set, so the budget shapes what backward recomputes here too."""
    from torch._dynamo.backends.registry import lookup_backend

    if not low_memory:
        return lookup_backend("aot_eager")(gm, example_inputs)
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    def run_as_is(graph: fx.GraphModule, _inputs):
        return make_boxed_func(graph.forward)

    compiler = aot_autograd(fw_compiler=run_as_is, bw_compiler=run_as_is,
                            partition_fn=partition_keeping_random)
    return compiler(gm, example_inputs)
