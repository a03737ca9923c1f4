"""Weight gradients of thin factors, computed in the orientation MKL runs fastest (CPU)."""

from __future__ import annotations

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor

from comera_compile.compile.graph.graph_nodes import call_with_value

aten = torch.ops.aten

# calibration: docs/cpu-performance.md, "Matmul orientation"
MIN_ROWS = 32  # the thin side: a rank, a factor's width, from ...
MAX_ROWS = 64  # ... up to here
MIN_DEPTH = 2048  # the reduction: rows of activations (batch x sequence)
MIN_WIDTH = 256  # the wide side: a layer's width ...
MAX_WIDTH = 2048  # ... up to here (at 3072 the transposed problem is slower)


def orient_thin_matmuls(graph: fx.Graph) -> int:
    """Rewrite each thin-by-wide weight-gradient matmul as its transposed problem; returns
    how many were rewritten."""
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.mm.default:
            continue
        left, right = node.args
        if not _thin_by_wide(left, right):
            continue
        mode = left.meta["val"].fake_mode
        with graph.inserting_before(node):
            left_t = call_with_value(graph, mode, aten.permute.default, left, [1, 0])
            right_t = call_with_value(graph, mode, aten.permute.default, right, [1, 0])
            swapped = call_with_value(graph, mode, aten.mm.default, right_t, left_t)
            result = call_with_value(graph, mode, aten.permute.default, swapped, [1, 0])
        node.replace_all_uses_with(result)
        graph.erase_node(node)
        rewritten += 1
    return rewritten


def _thin_by_wide(left, right) -> bool:
    """``left`` (m x k) is the transpose of a contiguous tensor, ``right`` (k x n) is
    contiguous, with static sizes MIN_ROWS <= m <= MAX_ROWS, k >= MIN_DEPTH and
    MIN_WIDTH <= n <= MAX_WIDTH."""
    if not (isinstance(left, fx.Node) and isinstance(right, fx.Node)):
        return False
    a, b = left.meta.get("val"), right.meta.get("val")
    if not (isinstance(a, FakeTensor) and isinstance(b, FakeTensor)):
        return False
    if a.dim() != 2 or b.dim() != 2 or a.dtype != torch.float32:
        return False
    sizes = (*a.shape, b.shape[1])
    if not all(isinstance(s, int) for s in sizes):
        return False  # a symbolic row count: the graph serves sizes this was not measured at
    m, k, n = sizes
    return a.stride() == (1, m) and b.is_contiguous() and worth_turning(m, k, n)


def worth_turning(m: int, k: int, n: int) -> bool:
    """Whether an ``m x k x n`` thin weight gradient runs faster transposed (measured)."""
    return MIN_ROWS <= m <= MAX_ROWS and k >= MIN_DEPTH and MIN_WIDTH <= n <= MAX_WIDTH

