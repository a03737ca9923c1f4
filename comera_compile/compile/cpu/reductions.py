"""Sums over the rows of a large activation, split into blocks of rows (CPU graphs)."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._subclasses.fake_tensor import FakeTensor

from comera_compile.compile.graph.graph_nodes import call_with_value

aten = torch.ops.aten

BLOCKS = (64, 32, 16)  # rows per block, the first that divides the row count
MIN_ROWS = 1024  # below this the one-pass walk stays in cache
EXACT_DTYPES = (torch.float32, torch.float64)  # partial sums kept at the sum's precision


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
        mode = source.meta["val"].fake_mode
        with graph.inserting_before(node):
            view = call_with_value(graph, mode, aten.view.default, source, blocked)
            partial = call_with_value(graph, mode, aten.sum.dim_IntList, view, [1])
            total = call_with_value(graph, mode, aten.sum.dim_IntList, partial, [0])
            if list(total.meta["val"].shape) != out_shape:  # keepdim=True: ones in front
                total = call_with_value(graph, mode, aten.view.default, total, out_shape)
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
    if not isinstance(val, FakeTensor) or not isinstance(out, torch.Tensor) or val.dim() < 2:
        return None
    if val.dtype not in EXACT_DTYPES or not dims:
        return None  # in bf16 / fp16 the partial sums would be rounded before the second sum
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


class SplitRowSums(CustomGraphPass):
    """Inductor's post-grad pass slot: :func:`split_row_sums`; its uuid (this file's hash)
    keys inductor's caches to it."""

    def __call__(self, graph: fx.Graph) -> None:
        split_row_sums(graph)

    def uuid(self) -> bytes:
        return hashlib.sha256(Path(__file__).read_bytes()).digest()
