"""Monarch matrices (Dao et al., ICML 2022): modes, shapes, counts, init, projection."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ._checks import positive_int, positive_ints

DEFAULT_BLOCKS = 4
"""The reference's default block count."""

GOOD_ENOUGH = 0.9
"""A block count that needs no padding is preferred while it keeps this share of the
parameters the best padded count would reach (padding costs a copy of the input)."""


def monarch_modes(in_features: int, out_features: int,
                  blocks: int = DEFAULT_BLOCKS) -> tuple[tuple[int, int], tuple[int, int]]:
    """``((b, p), (b, s))`` with blocks of ``p = ceil(in / b)`` inputs and ``s = ceil(out / b)``
    outputs (sizes that ``b`` does not divide are padded, as the reference does)."""
    in_features = positive_int("in_features", in_features)
    out_features = positive_int("out_features", out_features)
    blocks = positive_int("blocks", blocks)
    if blocks > min(in_features, out_features):
        raise ValueError(f"blocks={blocks} exceeds the layer's smaller side "
                         f"({in_features} -> {out_features}); use at most "
                         f"{min(in_features, out_features)}")
    return (blocks, -(-in_features // blocks)), (blocks, -(-out_features // blocks))


def check_monarch_modes(in_modes: Sequence[int], out_modes: Sequence[int]) -> None:
    """Two modes per side, the same block count first."""
    ins, outs = positive_ints("in_modes", in_modes), positive_ints("out_modes", out_modes)
    if len(ins) != 2 or len(outs) != 2 or ins[0] != outs[0]:
        raise ValueError(f"a Monarch layer takes in_modes=(blocks, block inputs) and "
                         f"out_modes=(blocks, block outputs) with the same blocks, got "
                         f"{list(in_modes)} and {list(out_modes)}; pass blocks=... instead")


def monarch_core_shapes(in_modes: Sequence[int],
                        out_modes: Sequence[int]) -> list[tuple[int, int, int]]:
    """``[(b, p, q), (b, q, s)]`` with ``q = min(p, s)``."""
    (b, p), (_, s) = in_modes, out_modes
    q = min(p, s)
    return [(b, p, q), (b, q, s)]


def monarch_params(in_modes: Sequence[int], out_modes: Sequence[int]) -> int:
    """Core entries, ``b q (p + s)``; also the multiply-adds of one input row."""
    return sum(math.prod(s) for s in monarch_core_shapes(in_modes, out_modes))


def monarch_fan_ins(in_modes: Sequence[int], out_modes: Sequence[int]) -> list[int]:
    """Entries each factor's blocks sum over: ``p`` and ``q``."""
    return [shape[1] for shape in monarch_core_shapes(in_modes, out_modes)]


def monarch_init_stds(in_modes: Sequence[int], out_modes: Sequence[int]) -> list[float]:
    """The reference's muP stds, from each factor's own block sizes."""
    from .btt import mup_std

    return [mup_std(shape[1], shape[2]) for shape in monarch_core_shapes(in_modes, out_modes)]


def monarch_blocks_for(in_features: int, out_features: int, params: float) -> int | None:
    """The block count whose layer holds the most parameters up to ``params`` (None if no
    count fits); a count with no padding wins while it keeps ``GOOD_ENOUGH`` of that."""
    best, best_exact = None, None
    for blocks in range(1, min(in_features, out_features) + 1):
        ins, outs = monarch_modes(in_features, out_features, blocks)
        count = monarch_params(ins, outs)
        if count > params:
            continue
        if best is None or count > best[0]:
            best = (count, blocks)
        exact = in_features % blocks == 0 and out_features % blocks == 0
        if exact and (best_exact is None or count > best_exact[0]):
            best_exact = (count, blocks)
    if best is None:
        return None
    if best_exact is not None and best_exact[0] >= GOOD_ENOUGH * best[0]:
        return best_exact[1]
    return best[1]


def monarch_multiply(x: Tensor, left: Tensor, right: Tensor) -> Tensor:
    """``x @ M`` for rows ``x`` of ``b p`` entries: two batched matmuls, no dense weight."""
    b, p, q = left.shape
    s = right.shape[2]
    rows = x.shape[0]
    h = torch.bmm(x.reshape(rows, b, p).transpose(0, 1), left)  # (b, rows, q)
    h = h.transpose(0, 1).reshape(rows, q, b).permute(2, 0, 1)  # (b, rows, q), permuted
    y = torch.bmm(h, right)  # (b, rows, s)
    return y.permute(1, 2, 0).reshape(rows, s * b)


def monarch_to_dense(left: Tensor, right: Tensor) -> Tensor:
    """The ``(b p, b s)`` matrix ``M`` (``x @ M``) of the factors (export and checks)."""
    b, p, _ = left.shape
    eye = torch.eye(b * p, dtype=left.dtype, device=left.device)
    return monarch_multiply(eye, left, right)


def _routes(b: int, q: int, k: int, l: int) -> tuple[list[int], list[int]]:
    """The intermediate channels from input block ``k`` to output block ``l``: columns ``j``
    of ``L[k]`` and rows ``t`` of ``R[l]`` with ``(k q + j) = t b + l``."""
    cols = [j for j in range(q) if (k * q + j) % b == l]
    return cols, [(k * q + j) // b for j in cols]


def monarch_project(w: Tensor, in_modes: Sequence[int], out_modes: Sequence[int]) -> list[Tensor]:
    """The Monarch matrix closest to ``w`` (``(b p, b s)``, ``x @ w``) in Frobenius norm."""
    check_monarch_modes(in_modes, out_modes)
    (b, p), (_, s) = in_modes, out_modes
    (_, _, q), _ = monarch_core_shapes(in_modes, out_modes)
    work = torch.float64 if w.dtype == torch.float64 else torch.float32
    blocks = w.to(work).reshape(b, p, s, b)  # [k, i, u, l]
    left = torch.zeros(b, p, q, dtype=work, device=w.device)
    right = torch.zeros(b, q, s, dtype=work, device=w.device)
    for k in range(b):
        for l in range(b):
            cols, rows = _routes(b, q, k, l)
            if not cols:
                continue
            u, sv, vh = torch.linalg.svd(blocks[k, :, :, l], full_matrices=False)
            n = len(cols)
            root = sv[:n].sqrt()
            left[k][:, cols] = u[:, :n] * root
            right[l][rows, :] = root.unsqueeze(-1) * vh[:n]
    return [left.to(w.dtype), right.to(w.dtype)]
