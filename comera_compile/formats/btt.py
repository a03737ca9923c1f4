"""Block Tensor-Train (BTT) matrices of two cores: modes, shapes, counts, init, projection."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ._checks import positive_int, positive_ints
from .factorize import factorize


def btt_modes(in_features: int, out_features: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The reference's modes: each size split into its two most even factors (padded where
    it factors badly), ascending; the input is read as ``(m1, m0)`` with ``m1 >= m0`` and
    the output as ``(n0, n1)`` with ``n0 <= n1``."""
    ms = factorize(positive_int("in_features", in_features), 2).modes
    ns = factorize(positive_int("out_features", out_features), 2).modes
    return (ms[1], ms[0]), (ns[0], ns[1])


def check_btt_modes(in_modes: Sequence[int], out_modes: Sequence[int]) -> None:
    """BTT has two cores: exactly two input and two output modes."""
    for name, modes in (("in_modes", in_modes), ("out_modes", out_modes)):
        if len(positive_ints(name, modes)) != 2:
            raise ValueError(f"a BTT layer of two cores takes two {name}, got {list(modes)}; "
                             "leave them as None to factorize automatically")


def btt_rank_cap(in_modes: Sequence[int], out_modes: Sequence[int]) -> int:
    """The rank at which BTT holds every dense matrix: ``min(m0, n1)`` (each block's size)."""
    return min(int(in_modes[1]), int(out_modes[1]))


def btt_core_shapes(in_modes: Sequence[int], out_modes: Sequence[int],
                    rank: int) -> list[tuple[int, ...]]:
    """``[(1, m1, m0, n0, r), (r, n0, m1, n1, 1)]``."""
    (m1, m0), (n0, n1) = in_modes, out_modes
    return [(1, m1, m0, n0, rank), (rank, n0, m1, n1, 1)]


def btt_params(in_modes: Sequence[int], out_modes: Sequence[int], rank: int) -> int:
    """Core entries: ``r (m1 m0 n0 + n0 m1 n1)``."""
    return sum(math.prod(s) for s in btt_core_shapes(in_modes, out_modes, rank))


def btt_macs_per_row(in_modes: Sequence[int], out_modes: Sequence[int], rank: int) -> int:
    """Multiply-adds of one input row: every core entry is used once (the reference's count)."""
    return btt_params(in_modes, out_modes, rank)


def btt_rank_for(in_modes: Sequence[int], out_modes: Sequence[int], params: float) -> int:
    """The largest rank whose cores hold at most ``params`` entries (0 if even rank 1 does
    not fit), capped at ``btt_rank_cap``."""
    per_rank = btt_params(in_modes, out_modes, 1)
    return max(0, min(int(params // per_rank), btt_rank_cap(in_modes, out_modes)))


def btt_fan_ins(in_modes: Sequence[int], rank: int) -> list[int]:
    """Entries each core sums over: ``A`` its block's ``m0`` inputs, ``B`` ``m1 r``."""
    return [int(in_modes[1]), int(in_modes[0]) * int(rank)]


def btt_fan_outs(out_modes: Sequence[int], rank: int) -> list[int]:
    """Outputs of each core's blocks: ``A`` ``n0 r``, ``B`` ``n1``."""
    return [int(out_modes[0]) * int(rank), int(out_modes[1])]


def mup_std(fan_in: int, fan_out: int) -> float:
    """The reference's muP std of one factor: ``sqrt(1 / d_in) * min(1, sqrt(d_out / d_in))``
    (spectral norm ``sqrt(d_out / d_in)``), from the factor's own block sizes."""
    return math.sqrt(1.0 / fan_in) * min(1.0, math.sqrt(fan_out / fan_in))


def btt_init_stds(in_modes: Sequence[int], out_modes: Sequence[int], rank: int) -> list[float]:
    """Per-core init stds of the reference's structure-aware (muP) initialisation."""
    return [mup_std(i, o) for i, o in zip(btt_fan_ins(in_modes, rank),
                                           btt_fan_outs(out_modes, rank))]


def btt_blocks(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """The cores as batched block factors: ``A`` ``(m1, m0, n0 r)`` and ``B`` ``(n0, m1 r, n1)``
    (``B`` is permuted: a copy the size of the core, never of the weight)."""
    _, m1, m0, n0, r = a.shape
    n1 = b.shape[3]
    left = a.reshape(m1, m0, n0 * r)
    right = b.reshape(r, n0, m1, n1).permute(1, 2, 0, 3).reshape(n0, m1 * r, n1)
    return left, right


def btt_multiply(x: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``x @ W`` for rows ``x`` of ``m1 m0`` entries: two batched matmuls, no dense weight."""
    _, m1, m0, n0, r = a.shape
    n1 = b.shape[3]
    rows = x.shape[0]
    left, right = btt_blocks(a, b)
    h = torch.bmm(x.reshape(rows, m1, m0).transpose(0, 1), left)  # (m1, rows, n0 r)
    h = h.reshape(m1, rows, n0, r).permute(2, 1, 0, 3).reshape(n0, rows, m1 * r)
    y = torch.bmm(h, right)  # (n0, rows, n1)
    return y.transpose(0, 1).reshape(rows, n0 * n1)


def btt_to_dense(a: Tensor, b: Tensor) -> Tensor:
    """The ``(m1 m0, n0 n1)`` matrix ``W`` (``x @ W``) of the cores (export and checks)."""
    _, m1, m0, n0, r = a.shape
    n1 = b.shape[3]
    w = torch.einsum("ijak,kaib->ijab", a.reshape(m1, m0, n0, r), b.reshape(r, n0, m1, n1))
    return w.reshape(m1 * m0, n0 * n1)


def btt_project(w: Tensor, in_modes: Sequence[int], out_modes: Sequence[int],
                rank: int) -> list[Tensor]:
    """The rank-``r`` BTT closest to ``w`` (``(m1 m0, n0 n1)``, ``x @ w``) in Frobenius norm."""
    (m1, m0), (n0, n1) = in_modes, out_modes
    if rank > btt_rank_cap(in_modes, out_modes):
        raise ValueError(f"rank {rank} exceeds the blocks' size {m0} x {n1}; "
                         f"use at most {btt_rank_cap(in_modes, out_modes)}")
    work = torch.float64 if w.dtype == torch.float64 else torch.float32
    blocks = w.reshape(m1, m0, n0, n1).permute(0, 2, 1, 3).to(work)  # (m1, n0, m0, n1)
    u, s, vh = torch.linalg.svd(blocks, full_matrices=False)
    root = s[..., :rank].sqrt()
    left = u[..., :rank] * root.unsqueeze(-2)  # (m1, n0, m0, r)
    right = root.unsqueeze(-1) * vh[..., :rank, :]  # (m1, n0, r, n1)
    a = left.permute(0, 2, 1, 3).reshape(1, m1, m0, n0, rank)
    b = right.permute(2, 1, 0, 3).reshape(rank, n0, m1, n1, 1)
    return [a.to(w.dtype).contiguous(), b.to(w.dtype).contiguous()]
