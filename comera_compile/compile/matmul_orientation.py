"""Each bond-thin matmul of a compiled CPU graph in the orientation that runs faster here.

``a @ b`` and its transposed problem ``(b.T @ a.T).T`` do the same multiply-adds, but a
CPU BLAS runs them at very different speeds when one side is a rank bond. With MKL on two
Zen 3 cores, at 1024 rows and width 384: an activation times a thin factor (``x @ U``, bond
9) ran 2.5x faster turned, the factor's gradient ``x.T @ dh`` 4-5x faster turned, while the
bond's own gradient ``h.T @ dy`` ran 4x slower turned; at bonds of 48 most shapes differ
by under 20%. Which form wins depends on the shapes, the strides, the dtype, the library
and the core, and a rule written once from one machine's table (an earlier one here turned
weight gradients 32 to 64 thin only) misses most of it. So the pass times both forms of
each such matmul on this machine while the graph compiles, and turns those that run at
least ``MIN_GAIN`` faster. Each operand layout is timed once per process; its operands
rotate through copies larger than a core's cache, as they come from memory in a step. A
turned matmul returns the same values up to float rounding (another summation order), so
two runs may round differently; under ``torch.use_deterministic_algorithms(True)`` nothing
is timed or turned.

:func:`orient_thin_matmuls` is the pass (the backend runs it on CPU graphs after autograd,
so backward matmuls are chosen too); :func:`faster_turned` is the measured choice.
``python benchmarks/kernels.py`` prints both forms' times for a few shapes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor

from comera_compile.compile.graph_nodes import call_with_value

aten = torch.ops.aten

MAX_BOND = 64
"""A matmul is timed when one of its three sizes is at most this (a rank bond): wider ones
run near the library's peak either way, and timing them costs more."""

MIN_GAIN = 1.15
"""The turned form must be this much faster to be used: a closer call is timing noise."""

ROUNDS = 3  # each form timed this many times, alternating; the fastest of each counts
CACHE_BYTES = 8 << 20  # operand copies rotate through at least this much memory

Layout = tuple[tuple[int, int], tuple[int, int], tuple[int, int], tuple[int, int],
               torch.dtype, int]
_choices: dict[Layout, bool] = {}


def orient_thin_matmuls(graph: fx.Graph) -> int:
    """Rewrite each bond-thin ``mm(a, b)`` that runs faster here as ``mm(b.T, a.T).T``;
    returns how many were rewritten (none under deterministic algorithms: timed choices
    can differ between runs)."""
    if torch.are_deterministic_algorithms_enabled():
        return 0
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.mm.default:
            continue
        left, right = node.args
        layout = _layout(left, right)
        if layout is None or not faster_turned(*layout[:5]):
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


def faster_turned(a_shape: tuple[int, int], a_stride: tuple[int, int],
                  b_shape: tuple[int, int], b_stride: tuple[int, int],
                  dtype: torch.dtype = torch.float32) -> bool:
    """Whether ``(b.T @ a.T).T`` runs at least ``MIN_GAIN`` faster than ``a @ b`` for
    operands of these shapes and strides, on this machine at the current thread count
    (timed on first ask, then remembered for the process)."""
    key = (tuple(a_shape), tuple(a_stride), tuple(b_shape), tuple(b_stride), dtype,
           torch.get_num_threads())
    if key not in _choices:
        written, turned = time_both_forms(*key[:5])
        _choices[key] = written >= MIN_GAIN * turned
    return _choices[key]


def time_both_forms(a_shape, a_stride, b_shape, b_stride, dtype=torch.float32
                    ) -> tuple[float, float]:
    """Seconds per call of ``a @ b`` and of ``(b.T @ a.T).T``: the fastest of ``ROUNDS``
    alternating rounds, each over operand copies that do not fit a core's cache."""
    pair_bytes = (math.prod(a_shape) + math.prod(b_shape)) * dtype.itemsize
    copies = max(1, min(8, -(-CACHE_BYTES // pair_bytes)))
    pairs = [(_strided(a_shape, a_stride, dtype), _strided(b_shape, b_stride, dtype))
             for _ in range(copies)]

    def written() -> None:
        for a, b in pairs:
            torch.mm(a, b)

    def turned() -> None:
        for a, b in pairs:
            torch.mm(b.t(), a.t()).t()

    written(), turned()  # warm-up: first-touch pages, library set-up
    best = [math.inf, math.inf]
    for _ in range(ROUNDS):
        for i, form in enumerate((written, turned)):
            best[i] = min(best[i], _seconds(form))
    return best[0] / copies, best[1] / copies


def _seconds(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _strided(shape, stride, dtype) -> torch.Tensor:
    """A random tensor of this shape laid out with these strides."""
    if stride[0] >= stride[1]:
        return torch.randn(shape, dtype=dtype)
    return torch.randn(shape[::-1], dtype=dtype).t()


def _layout(left, right) -> Layout | None:
    """The timing key of ``mm(left, right)`` when it is worth timing: fake values on CPU,
    2-D, floating point, static sizes with one at most ``MAX_BOND``, each operand
    contiguous or the transpose of a contiguous tensor; else None."""
    if not (isinstance(left, fx.Node) and isinstance(right, fx.Node)):
        return None
    a, b = left.meta.get("val"), right.meta.get("val")
    if not (isinstance(a, FakeTensor) and isinstance(b, FakeTensor)):
        return None
    if a.dim() != 2 or b.dim() != 2 or a.device.type != "cpu" or not a.is_floating_point():
        return None
    sizes = (*a.shape, b.shape[1])
    if not all(isinstance(s, int) for s in sizes) or min(sizes) > MAX_BOND:
        return None  # symbolic: the graph serves sizes this was not timed at
    if not (_dense_2d(a) and _dense_2d(b)) or a.dtype != b.dtype:
        return None
    return (tuple(a.shape), tuple(a.stride()), tuple(b.shape), tuple(b.stride()), a.dtype,
            torch.get_num_threads())


def _dense_2d(t: torch.Tensor) -> bool:
    """Contiguous, or the transpose of a contiguous tensor (what matmuls take without a copy)."""
    rows, cols = t.shape
    stride = tuple(t.stride())
    if not all(isinstance(s, int) for s in stride):
        return False
    return stride == (cols, 1) or stride == (1, rows)
