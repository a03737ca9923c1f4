"""A TT lookup's gathered contractions as single autograd nodes, their backwards written out.

A recommender's lookup is a dozen tiny ops on a few thousand ids; an autograd node per op
costs about what the op does, and a batched matmul of ``(1, r) x (r, n)`` matrices costs more
per matrix than its arithmetic. So the chain runs as one node (:class:`GatheredChain`), a
cached table's lookup as one more (:class:`CachedChain`), rank-one products as multiplies,
and each core's gradient comes straight from its slices' gradients: sparse (the slices the
ids read, as ``nn.Embedding(sparse=True)`` gives its rows) or added into a zero core.
Cores are slices first, ``(m_k, r_{k-1}, n_k, r_k)``; ``digits[k]`` picks each row's slice.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

SMALL_BOND = 16
"""Bond size up to which a one-row contraction runs as a broadcast multiply and a sum: a
batched matmul of many tiny matrices costs more per matrix than its arithmetic."""


@functools.cache
def _autocast_devices() -> tuple[str, ...]:
    return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


def _without_autocast(fn):
    """Run a node's forward or backward with autocast off: the lookup computes in its cores'
    dtype (as ``nn.Embedding`` does under autocast), its backward in the dtypes forward
    saved, whichever autocast context the caller runs ``backward`` in."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        casting = [d for d in _autocast_devices() if torch.is_autocast_enabled(d)]
        if not casting:
            return fn(*args, **kwargs)
        with contextlib.ExitStack() as stack:
            for device in casting:
                stack.enter_context(torch.autocast(device, enabled=False))
            return fn(*args, **kwargs)

    return run


def _times_slices(acc: Tensor, g: Tensor) -> Tensor:
    """``acc (b, w, r)`` times ``g (b, r, n r')`` per row -> ``(b, w, n r')``."""
    rows, width, rank = acc.shape
    if width == 1 and rank <= SMALL_BOND:
        return (acc.view(rows, rank, 1) * g).sum(1, keepdim=True)
    return torch.bmm(acc, g)


def _back_through_slices(grad: Tensor, g: Tensor, width: int) -> Tensor:
    """The gradient of :func:`_times_slices` for its ``acc``: ``grad g^T`` -> ``(b, w, r)``."""
    rows, rank = g.shape[0], g.shape[1]
    if width == 1 and rank <= SMALL_BOND:
        return (g * grad).sum(2).view(rows, 1, rank)
    return torch.bmm(grad, g.transpose(1, 2))


def _slices_gradient(acc: Tensor, grad: Tensor) -> Tensor:
    """The gradient of :func:`_times_slices` for its slices: ``acc^T grad``, an outer product
    per row where ``w == 1`` (a multiply runs it several times faster than a batched matmul)."""
    rows, width, rank = acc.shape
    if width == 1:
        return acc.view(rows, rank, 1) * grad
    return torch.bmm(acc.transpose(1, 2), grad)


def rows_gradient(rows: Tensor, index: Tensor, shape: Sequence[int], sparse: bool) -> Tensor:
    """The gradient of a ``shape`` parameter whose ``index`` rows got ``rows``: sparse (the
    rows read, repeats summed when coalesced) or dense."""
    rows = rows.reshape(rows.shape[0], *shape[1:])
    if sparse:
        return torch.sparse_coo_tensor(index.unsqueeze(0), rows, tuple(shape),
                                       check_invariants=False)
    return rows.new_zeros(shape).index_add_(0, index, rows)


def interleave(first: Tensor, at_first: Tensor, second: Tensor, at_second: Tensor) -> Tensor:
    """``first`` rows at positions ``at_first`` and ``second`` rows at ``at_second`` of one
    output in ``second``'s dtype (the positions partition it)."""
    out = second.new_empty(at_first.numel() + at_second.numel(), second.shape[1])
    out.index_copy_(0, at_first, first.to(second.dtype))
    return out.index_copy_(0, at_second, second)


def chain_forward(digits: Sequence[Tensor], cores: Sequence[Tensor],
                  gates: Sequence[Tensor]) -> tuple[Tensor, list[Tensor]]:
    """Rows ``(b, prod(n), 1)`` of the chain for each row's ``digits``, and what
    :func:`chain_backward` needs (each step's input, gated input and gathered slices)."""
    rows = digits[0].shape[0]
    first = cores[0]
    acc = first.index_select(0, digits[0]).view(rows, first.shape[2], first.shape[3])
    saved = []
    for k in range(1, len(cores)):
        plain = acc
        if gates:  # scale the bond between cores k-1 and k
            acc = acc * gates[k - 1]
        _, r, n, r_next = cores[k].shape
        g = cores[k].index_select(0, digits[k]).view(rows, r, n * r_next)
        saved += [plain, acc, g]
        acc = _times_slices(acc, g).view(rows, acc.shape[1] * n, r_next)
    return acc, saved


def chain_backward(grad: Tensor, digits: Sequence[Tensor], shapes: Sequence[torch.Size],
                   gates: Sequence[Tensor], saved: Sequence[Tensor], wants: Sequence[bool],
                   sparse: Sequence[bool]) -> tuple[list[Tensor | None], list[Tensor | None]]:
    """Gradients of the cores (sparse where ``sparse[k]``) and gates (``wants``: cores',
    then gates' flags) for ``grad`` of :func:`chain_forward`'s rows."""
    order, rows = len(shapes), digits[0].shape[0]
    grad_cores: list[Tensor | None] = [None] * order
    grad_gates: list[Tensor | None] = [None] * len(gates)
    for k in range(order - 1, 0, -1):
        plain, acc, g = saved[3 * (k - 1):3 * k]
        width = acc.shape[1]
        grad = grad.reshape(rows, width, g.shape[2])
        if wants[k]:
            grad_cores[k] = rows_gradient(_slices_gradient(acc, grad), digits[k], shapes[k],
                                          sparse[k])
        grad = _back_through_slices(grad, g, width)  # (b, w, r)
        if gates:
            if wants[order + k - 1]:
                grad_gates[k - 1] = (grad * plain).sum((0, 1))
            grad = grad * gates[k - 1]
    if wants[0]:
        grad_cores[0] = rows_gradient(grad, digits[0], shapes[0], sparse[0])
    return grad_cores, grad_gates


def per_core(sparse: bool | Sequence[bool], order: int) -> tuple[bool, ...]:
    """Whether each core's gradient is sparse: one flag for all, or a flag per core."""
    if isinstance(sparse, bool):
        return (sparse,) * order
    if len(sparse) != order:
        raise ValueError(f"expected {order} sparse flags, got {len(sparse)}")
    return tuple(bool(s) for s in sparse)


def _split(tensors: Sequence[Tensor], order: int) -> tuple:
    """``(digits, cores, gates)`` of ``*digits, *cores, *gates`` (``order`` cores)."""
    return tensors[:order], tensors[order:2 * order], tensors[2 * order:]


def _save_chain(ctx, sparse: bool | Sequence[bool], digits: Sequence[Tensor],
                cores: Sequence[Tensor], gates: Sequence[Tensor], saved: Sequence[Tensor],
                *extra: Tensor) -> None:
    """Keep what :func:`chain_backward` needs (``extra`` tensors first)."""
    ctx.save_for_backward(*extra, *digits, *gates, *saved)
    ctx.order, ctx.gated, ctx.extra = len(cores), bool(gates), len(extra)
    ctx.sparse, ctx.shapes = per_core(sparse, len(cores)), [c.shape for c in cores]


def _saved_chain(ctx) -> tuple:
    """``(extra, digits, gates, saved)`` as :func:`_save_chain` kept them."""
    tensors, order, extra = ctx.saved_tensors, ctx.order, ctx.extra
    gated = order - 1 if ctx.gated else 0
    digits = tensors[extra:extra + order]
    gates = tensors[extra + order:extra + order + gated]
    return tensors[:extra], digits, gates, tensors[extra + order + gated:]


class GatheredChain(torch.autograd.Function):
    """The chain of ``apply(sparse, d, *digits, *cores, *gates)`` (``d`` cores, ``d - 1``
    gates or none; ``sparse``: one flag for all cores or one each) per row, as one node:
    rows ``(b, prod(n), 1)``."""

    @staticmethod
    @_without_autocast
    def forward(ctx, sparse: bool | Sequence[bool], order: int, *tensors: Tensor) -> Tensor:
        digits, cores, gates = _split(tensors, order)
        out, saved = chain_forward(digits, cores, gates)
        _save_chain(ctx, sparse, digits, cores, gates, saved)
        return out

    @staticmethod
    @once_differentiable
    @_without_autocast
    def backward(ctx, grad: Tensor):
        _, digits, gates, saved = _saved_chain(ctx)
        cores, gates_grad = chain_backward(grad, digits, ctx.shapes, gates, saved,
                                           ctx.needs_input_grad[2 + ctx.order:], ctx.sparse)
        return None, None, *([None] * ctx.order), *cores, *gates_grad


class CachedChain(torch.autograd.Function):
    """A cached table's rows, as one node: ``apply(sparse, cache_sparse, d, width, weight,
    slots, hits, misses, *digits, *cores, *gates)``. Rows at ``hits`` are the cache's
    ``weight[slots]``; rows at ``misses`` come from the chain for ``digits`` (the misses'
    ids), cut to ``width`` columns. No row reads both."""

    @staticmethod
    @_without_autocast
    def forward(ctx, sparse: bool | Sequence[bool], cache_sparse: bool, order: int, width: int,
                weight: Tensor, slots: Tensor, hits: Tensor, misses: Tensor,
                *tensors: Tensor) -> Tensor:
        digits, cores, gates = _split(tensors, order)
        built, saved = chain_forward(digits, cores, gates)
        flat = built.view(built.shape[0], built.shape[1] * built.shape[2])  # rows may be 0
        out = interleave(weight.index_select(0, slots), hits, flat[:, :width], misses)
        _save_chain(ctx, sparse, digits, cores, gates, saved, slots, hits, misses)
        ctx.cache_sparse, ctx.weight = cache_sparse, (weight.shape, weight.dtype)
        ctx.built_width = flat.shape[1]
        return out

    @staticmethod
    @once_differentiable
    @_without_autocast
    def backward(ctx, grad: Tensor):
        (slots, hits, misses), digits, gates, saved = _saved_chain(ctx)
        grad_weight = None
        if ctx.needs_input_grad[4]:
            shape, dtype = ctx.weight
            grad_weight = rows_gradient(grad.index_select(0, hits).to(dtype), slots, shape,
                                        ctx.cache_sparse)
        missed = grad.index_select(0, misses)
        if missed.shape[1] < ctx.built_width:  # the chain's padded columns get no gradient
            missed = torch.nn.functional.pad(missed, (0, ctx.built_width - missed.shape[1]))
        cores, gates_grad = chain_backward(missed, digits, ctx.shapes, gates, saved,
                                           ctx.needs_input_grad[8 + ctx.order:], ctx.sparse)
        return (None, None, None, None, grad_weight, None, None, None,
                *([None] * ctx.order), *cores, *gates_grad)


class GatheredContraction(torch.autograd.Function):
    """``acc (b, w, r)`` times each row's slice ``core[digit]`` as one node: one step of the
    chain, for the per-core choice between gathering and bucketing."""

    @staticmethod
    @_without_autocast
    def forward(ctx, acc: Tensor, core: Tensor, digit: Tensor, sparse: bool) -> Tensor:
        rows, width, _ = acc.shape
        _, r, n, r_next = core.shape
        g = core.index_select(0, digit).view(rows, r, n * r_next)  # sizes spelled: rows may be 0
        ctx.save_for_backward(acc, g, digit)
        ctx.core_shape, ctx.sparse = core.shape, sparse
        return _times_slices(acc, g).view(rows, width * n, r_next)

    @staticmethod
    @once_differentiable
    @_without_autocast
    def backward(ctx, grad: Tensor):
        acc, g, digit = ctx.saved_tensors
        rows, width, _ = acc.shape
        grad = grad.reshape(rows, width, g.shape[2])
        grad_acc = grad_core = None
        if ctx.needs_input_grad[0]:
            grad_acc = _back_through_slices(grad, g, width)
        if ctx.needs_input_grad[1]:
            grad_core = rows_gradient(_slices_gradient(acc, grad), digit, ctx.core_shape,
                                      ctx.sparse)
        return grad_acc, grad_core, None, None
