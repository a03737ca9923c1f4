"""Sums over the rows of a large activation, split into blocks of rows (CPU graphs).

Backward sums the gradient over its rows for every bias and LayerNorm weight:
``sum(g, [0])`` over a 4096 x 3072 gradient. Inductor's CPU loop for it walks each group
of 8 columns down all 4096 rows, one row (a 12 KiB stride, a new page) per load, and
spends three times aten's time (``python benchmarks/kernels.py``). Summing blocks of 64
rows first, then the 64 partial rows, keeps each walk within a few hundred KiB, as fast
as aten, and still fuses with the kernel that produced the gradient.

:class:`SplitRowSums` is the post-grad pass the backend gives inductor for CPU graphs. The
result differs from the one-pass sum only by float rounding (another summation order).
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

aten = torch.ops.aten

BLOCKS = (64, 32, 16)  # rows per block, the first that divides the row count
MIN_ROWS = 1024  # below this the one-pass walk stays in cache


def split_row_sums(graph: fx.Graph, min_rows: int = MIN_ROWS) -> int:
    """Rewrite every ``sum(x, leading dims)`` of a contiguous ``x`` with at least
    ``min_rows`` (static) rows into a sum over blocks of rows, then over the blocks.
    Returns how many sums were rewritten."""
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.sum.dim_IntList:
            continue
        plan = _blocked_shape(node, min_rows)
        if plan is None:
            continue
        source, blocked, out_shape = plan
        with graph.inserting_before(node):
            view = _call(graph, aten.view.default, (source, blocked))
            partial = _call(graph, aten.sum.dim_IntList, (view, [1]))
            total = _call(graph, aten.sum.dim_IntList, (partial, [0]))
            if list(total.meta["val"].shape) != out_shape:  # keepdim=True: ones in front
                total = _call(graph, aten.view.default, (total, out_shape))
        node.replace_all_uses_with(total)
        graph.erase_node(node)
        rewritten += 1
    return rewritten


def _blocked_shape(node: fx.Node, min_rows: int):
    """``(input, blocked view shape, output shape)`` when ``node`` is a sum this pass
    splits, else None."""
    source, dims = node.args[0], node.args[1]
    if node.kwargs.get("dtype") is not None or not isinstance(source, fx.Node):
        return None
    val, out = source.meta.get("val"), node.meta.get("val")
    if not isinstance(val, torch.Tensor) or not isinstance(out, torch.Tensor) or val.dim() < 2:
        return None
    if not val.dtype.is_floating_point or not dims:
        return None
    shape = list(val.shape)
    if not all(isinstance(s, int) for s in shape) or not val.is_contiguous():
        return None  # symbolic shapes (a dynamic batch) keep inductor's own loop
    leading = sorted(d % val.dim() for d in dims)
    if leading != list(range(len(leading))) or len(leading) == val.dim():
        return None
    rows, rest = math.prod(shape[: len(leading)]), shape[len(leading):]
    block = next((b for b in BLOCKS if rows % b == 0), None)
    if rows < min_rows or block is None:
        return None
    return source, [rows // block, block, *rest], list(out.shape)


def _call(graph: fx.Graph, target, args) -> fx.Node:
    """A new node with its fake value, computed from its inputs' fake values."""
    node = graph.call_function(target, args)
    fake_args = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
    node.meta["val"] = target(*fake_args)
    return node


class SplitRowSums(CustomGraphPass):
    """Inductor's post-grad pass slot: :func:`split_row_sums`; its uuid (this file's hash)
    keys inductor's caches to it."""

    def __call__(self, graph: fx.Graph) -> None:
        split_row_sums(graph)

    def uuid(self) -> bytes:
        return hashlib.sha256(Path(__file__).read_bytes()).digest()
