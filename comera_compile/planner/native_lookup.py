"""A TT table's lookup as one C loop over its ids (``tt_lookup.c``), forward and backward.

The torch form of a lookup (:mod:`.gathered`) runs a few dozen ops per table and step, each
costing about what its arithmetic does at a recommender's sizes; this runs the id check,
the cache's hash probes, each missed id's chain (rank gates thresholded as
``nn.gates.hard_threshold`` does) and its gradients in one call each way. Backward rebuilds a
missed row's partial products rather than keeping them, so a step keeps only the ids'
positions and digits. Built on first use with the system's C compiler; where it cannot be
(no compiler, not Linux, ``COMERA_NATIVE_LOOKUP=0``), lookups run as torch ops, the same
numbers up to float rounding."""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
import weakref
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from . import native
from .gathered import _without_autocast, per_core, rows_gradient

log = logging.getLogger("comera_compile")

SOURCE = Path(__file__).with_name("tt_lookup.c")
NAME = "tt_lookup"
MAX_ORDER = 32  # the kernel's per-row bookkeeping holds 64 cores
MAX_ROW_MACS = 512
"""Multiply-adds a row may cost to build for the C loop to take it. Past it torch's batched
products build rows as fast or faster (timed forward and backward, 2,048 ids, 2 threads: a
rank-8 chain of six cores, 1,088 a row, ran 2.9 ms in C against 2.4 ms as torch ops; rows of
a recommender's rank-5 table, 80 a row, run several times faster in C)."""
_TYPES = {torch.float32: "f32", torch.float64: "f64"}


def _command(target: Path, openmp: bool = True) -> list[str]:
    """The compiler command; ``openmp``: the loops join the OpenMP runtime torch loaded
    (``libgomp.so.1`` is loaded once per process, so the library shares torch's threads)."""
    return [os.environ.get("CC", "cc"), "-O3", "-std=c11", "-shared", "-fPIC",
            *(["-fopenmp"] if openmp else []), str(SOURCE), "-o", str(target)]


def _libgomp_loaded() -> bool:
    """Whether torch runs on GNU OpenMP (its ``libgomp`` mapped in this process): only then
    does a library built with ``-fopenmp`` share its threads rather than start its own."""
    try:
        return "libgomp" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def _build() -> bytes:
    """The library, with OpenMP where the compiler and torch's runtime give it."""
    if _libgomp_loaded():
        try:
            return native.build(NAME, SOURCE, _command)
        except Exception as err:
            log.info("comera: the C lookup of TT tables builds without OpenMP (%s)",
                     native.why_not(err))
    return native.build(NAME + "_serial", SOURCE, functools.partial(_command, openmp=False))


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The built kernels, or None (with one INFO line saying why) where they cannot be."""
    if os.environ.get("COMERA_NATIVE_LOOKUP", "1").strip().lower() in ("0", "off", "no"):
        return None
    if not native.can_load():
        return None
    try:
        lib = native.load(NAME, _build())
    except Exception as err:  # any failure: lookups run as torch ops
        log.info("comera: the C lookup of TT tables could not be built (%s); lookups run as "
                 "torch ops", native.why_not(err))
        return None
    i64, ptr, ptrs, num = ctypes.c_int64, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), \
        ctypes.c_int
    lib.comera_tt_index.restype = None
    lib.comera_tt_index.argtypes = [i64, ptr, num, ptr]
    for suffix in _TYPES.values():
        forward = getattr(lib, f"comera_tt_forward_{suffix}")
        forward.restype = i64
        forward.argtypes = [num, i64, ptr, i64, num, ptr, ptr, i64, ptr, ptr, num, ptr, ptr, ptr,
                            ptrs, ptrs, ctypes.c_double, i64, num]
        grads = getattr(lib, f"comera_tt_grads_{suffix}")
        grads.restype = num
        grads.argtypes = [num, i64, ptr, i64, ptr, ptr, i64, ptr, ptr, i64, num, ptr, ptr, ptr,
                          ptrs, ptrs, ctypes.c_double, ptrs, ptrs, ptr, i64, num]
    return lib


OP_SOURCE = Path(__file__).with_name("tt_lookup_op.cpp")
OP_NAME = "tt_lookup_op"


def _op_command(target: Path) -> list[str]:
    """Builds the C loops (as C) and their torch operator (as C++, against this torch)."""
    from torch.utils.cpp_extension import include_paths, library_paths  # needs setuptools

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    lib = library_paths()[0]
    return [os.environ.get("CXX", "c++"), "-O3", "-fopenmp", "-shared", "-fPIC",
            "-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *(f"-I{p}" for p in include_paths()), "-x", "c", str(SOURCE), "-x", "c++",
            str(OP_SOURCE), "-o", str(target), f"-L{lib}", "-lc10", "-ltorch_cpu", "-ltorch",
            f"-Wl,-rpath,{lib}"]


@functools.cache
def _operator():
    """``torch.ops.comera_native.tt_lookup``: the C loops with their autograd in C++ (a
    backward that runs no Python), or None where it cannot be built (the loops then run
    under :class:`NativeLookup`, whose backward is Python)."""
    if _library() is None or not _libgomp_loaded():
        return None
    try:
        data = native.build(OP_NAME, OP_SOURCE, _op_command,
                            torch.__version__ + SOURCE.read_text())
        native.load(OP_NAME, data)  # registers the operator
        return torch.ops.comera_native.tt_lookup
    except Exception as err:
        log.info("comera: the C++ operator of the TT lookup could not be built (%s); the C "
                 "lookup runs under a Python autograd node", native.why_not(err))
        return None


def lookup(sparse: bool | Sequence[bool], cache_sparse: bool, order: int, width: int,
           limit: int, threshold: float, ids: Tensor, cache_ids: Tensor | None,
           cache_weight: Tensor | None, *tensors: Tensor, bag: int = 1,
           mean: bool = False) -> Tensor:
    """A lookup in C (where :func:`usable`): the arguments of :class:`NativeLookup`, run by
    the C++ operator where it is built. ``bag > 1``: runs of ``bag`` ids pooled (summed, or
    averaged where ``mean``), ``(len(ids) // bag, width)``; the operator pools in C."""
    op = _operator()
    if op is None:
        rows = NativeLookup.apply(sparse, cache_sparse, order, width, limit, threshold, ids,
                                  cache_ids, cache_weight, *tensors)
        if bag == 1:
            return rows
        rows = rows.view(-1, bag, width)
        return rows.mean(1) if mean else rows.sum(1)
    empty = ids.new_empty(0)
    bits, index = cache_index(cache_ids) if cache_ids is not None else (0, empty)
    weight = cache_weight if cache_weight is not None else tensors[0].new_empty(0)
    flags = [sparse] if isinstance(sparse, bool) else list(sparse)
    return op(ids, index, weight, list(tensors[:order]), list(tensors[order:]), flags,
              cache_sparse, width, limit, threshold, bits, bag, mean)


def available() -> bool:
    """Whether the C lookup is built and loaded in this process (builds it if not yet)."""
    return _library() is not None


def _plain(t: Tensor, dtype: torch.dtype) -> bool:
    return (type(t) in (Tensor, torch.nn.Parameter) and t.device.type == "cpu"
            and t.dtype == dtype and not torch._C._functorch.is_functorch_wrapped_tensor(t))


def usable(ids: Tensor, cores: Sequence[Tensor], row_macs: int,
           cache_weight: Tensor | None = None, gates: Sequence[Tensor] = ()) -> bool:
    """Whether this lookup can run in C: plain CPU tensors of one float type (32 or 64 bit)
    outside a compiled graph, rows cheap enough (``MAX_ROW_MACS``), the kernels built."""
    dtype = cores[0].dtype
    if (dtype not in _TYPES or len(cores) > MAX_ORDER or row_macs > MAX_ROW_MACS
            or torch.compiler.is_compiling()):
        return False
    tensors = [*cores, *gates, *([] if cache_weight is None else [cache_weight])]
    if not all(_plain(t, dtype) for t in tensors) or not _plain(ids, ids.dtype):
        return False
    return available()


def _int64s(values: Sequence[int]):
    return (ctypes.c_int64 * len(values))(*values)


def _pointers(tensors: Sequence[Tensor | None]):
    return (ctypes.c_void_p * len(tensors))(*[None if t is None else t.data_ptr()
                                              for t in tensors])


_shapes: dict[tuple, tuple] = {}  # core shapes -> the kernel's m, n and r arrays


def _shape(cores: Sequence[Tensor]) -> tuple:
    """The kernel's ``m``, ``n`` and ``r`` arrays for slices-first cores."""
    key = tuple(c.shape for c in cores)
    arrays = _shapes.get(key)
    if arrays is None:
        arrays = _shapes[key] = (_int64s([c.shape[0] for c in cores]),
                                 _int64s([c.shape[2] for c in cores]),
                                 _int64s([cores[0].shape[1], *(c.shape[3] for c in cores)]))
    return arrays


_indexes: dict[int, tuple] = {}  # id(cache_ids) -> (its weakref, key, bits, table)
MAX_LOAD = 0.7  # the index's filled share of buckets at most


def cache_index(cache_ids: Tensor) -> tuple[int, Tensor]:
    """``(bits, table)``: a hash index of ``cache_ids`` (``tt_lookup.c``'s
    ``comera_tt_index``, 2^bits buckets), built once per value of ``cache_ids`` (it is
    built again after any write to it: a fill, a load, a broadcast)."""
    key = (cache_ids._version, cache_ids.data_ptr(), cache_ids.numel())
    held = _indexes.get(id(cache_ids))
    if held is not None and held[0]() is cache_ids and held[1] == key:
        return held[2], held[3]
    bits = max(4, math.ceil(math.log2(cache_ids.numel() / MAX_LOAD + 1)))
    table = torch.empty(2 << bits, dtype=torch.int64)
    ids = cache_ids.contiguous()
    _library().comera_tt_index(ids.numel(), ids.data_ptr(), bits, table.data_ptr())
    for name in [n for n, held in _indexes.items() if held[0]() is None]:
        del _indexes[name]  # tables gone
    _indexes[id(cache_ids)] = (weakref.ref(cache_ids), key, bits, table)
    return bits, table


def _check(status: int) -> None:
    if status:
        raise MemoryError("the C lookup could not allocate its scratch rows")


class NativeLookup(torch.autograd.Function):
    """``apply(sparse, cache_sparse, order, width, limit, threshold, ids, cache_ids,
    cache_weight, *cores, *gates)`` (``order`` cores, ``order - 1`` raw rank gates or none):
    rows ``(len(ids), width)``, the cache's ``cache_weight[slot]`` for ids in ``cache_ids``
    (``None``: no cache), the chain's for the others, each gate entry of ``|g| <= threshold``
    a zero (``nn.gates.hard_threshold``). Ids outside ``[0, limit)`` raise ``IndexError``.
    ``sparse``: the cores' gradients are sparse (one flag, or one per core), as
    :class:`.gathered.CachedChain`'s."""

    @staticmethod
    @_without_autocast
    def forward(ctx, sparse: bool | Sequence[bool], cache_sparse: bool, order: int,
                width: int, limit: int, threshold: float, ids: Tensor, cache_ids: Tensor | None,
                cache_weight: Tensor | None, *tensors: Tensor) -> Tensor:
        lib = _library()
        cores = [c.contiguous() for c in tensors[:order]]
        gates = [g.contiguous() for g in tensors[order:]]
        ids = ids.contiguous().long()
        count, dtype = ids.numel(), cores[0].dtype
        modes, cols, ranks = _shape(cores)
        bits, index = cache_index(cache_ids) if cache_ids is not None else (0, None)
        weight = None if cache_weight is None else cache_weight.contiguous()
        work = ids.new_empty(3 + order, count)  # positions of hits and misses, digits
        out = cores[0].new_empty(count, width)
        hits = getattr(lib, f"comera_tt_forward_{_TYPES[dtype]}")(
            torch.get_num_threads(), count, ids.data_ptr(), limit, bits,
            None if index is None else index.data_ptr(),
            None if weight is None else weight.data_ptr(), width, out.data_ptr(),
            work.data_ptr(), order, modes, cols, ranks, _pointers(cores),
            _pointers(gates) if gates else None, threshold, 1, 0)
        if hits == -1:
            low, high = (int(v) for v in torch.aminmax(ids))
            raise IndexError(f"ids must lie in [0, {limit}), got [{low}, {high}]")
        if hits < 0:
            raise MemoryError("the C lookup could not allocate its scratch rows")
        ctx.save_for_backward(work, *cores, *gates)
        ctx.order, ctx.width, ctx.hits, ctx.threshold = order, width, hits, threshold
        ctx.sparse, ctx.cache_sparse = per_core(sparse, order), cache_sparse
        ctx.weight = None if weight is None else (weight.shape, weight.dtype)
        return out

    @staticmethod
    @once_differentiable
    @_without_autocast
    def backward(ctx, grad: Tensor):
        lib, order, hits = _library(), ctx.order, ctx.hits
        work, *tensors = ctx.saved_tensors
        cores, gates = tensors[:order], tensors[order:]
        dtype, count = cores[0].dtype, work.shape[1]
        grad = grad.to(dtype).contiguous()
        misses = count - hits
        wants = ctx.needs_input_grad
        hit_grad = grad.new_empty(hits, ctx.width) if ctx.weight and wants[8] else None
        wants_cores = wants[9:9 + order]
        dense = [c.new_empty(c.shape) if want and not sparse else None  # written whole
                 for c, want, sparse in zip(cores, wants_cores, ctx.sparse)]
        rows = [c.new_empty(misses, c[0].numel()) if want and sparse else None
                for c, want, sparse in zip(cores, wants_cores, ctx.sparse)]
        wants_gates = any(wants[9 + order:])
        gate_grad = grad.new_empty(sum(g.numel() for g in gates)) if wants_gates else None
        modes, cols, ranks = _shape(cores)
        _check(getattr(lib, f"comera_tt_grads_{_TYPES[dtype]}")(
            torch.get_num_threads(), ctx.width, grad.data_ptr(), hits, work[0].data_ptr(),
            None if hit_grad is None else hit_grad.data_ptr(), misses, work[2].data_ptr(),
            work[3].data_ptr(), count, order, modes, cols, ranks, _pointers(cores),
            _pointers(gates) if gates else None, ctx.threshold, _pointers(dense),
            _pointers(rows), None if gate_grad is None else gate_grad.data_ptr(), 1, 0))
        grad_weight = None
        if hit_grad is not None:
            shape, weight_dtype = ctx.weight
            grad_weight = rows_gradient(hit_grad.to(weight_dtype), work[1, :hits], shape,
                                        ctx.cache_sparse)
        grad_cores = [d if d is not None else (
            None if r is None else rows_gradient(r, work[3 + k, :misses], cores[k].shape, True))
            for k, (d, r) in enumerate(zip(dense, rows))]
        grad_gates = [None] * len(gates)
        if gate_grad is not None:  # summed in double, written in the cores' dtype
            grad_gates = [part if want else None for part, want in zip(
                gate_grad.split([g.numel() for g in gates]), wants[9 + order:])]
        return (None, None, None, None, None, None, None, None, grad_weight, *grad_cores,
                *grad_gates)
