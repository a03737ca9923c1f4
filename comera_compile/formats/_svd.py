"""Sequential truncated SVD of a tensor into a chain of 3-way cores (Oseledets' TT-SVD)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .ranks import internal_ranks

_SVD_UNSUPPORTED = (torch.float16, torch.bfloat16)
# A bond whose rank cap is at most this share of the unfolding's short side gets a randomized
# SVD: a few passes over the matrix instead of the full decomposition (``python
# benchmarks/pretrained.py`` times the dense init of a pretrained model's tables).
_RANDOMIZED_SHARE = 0.4
_RANDOMIZED_MIN_SIDE = 512
_OVERSAMPLE = 16
_POWER_ITERATIONS = 4


def leading_svd(matrix: Tensor, rank: int) -> tuple[Tensor, Tensor, Tensor]:
    """``u, s, vh`` holding (at least) the ``rank`` leading singular triplets of ``matrix``."""
    short = min(matrix.shape)
    if short < _RANDOMIZED_MIN_SIDE or rank > _RANDOMIZED_SHARE * short:
        return torch.linalg.svd(matrix, full_matrices=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        u, s, v = torch.svd_lowrank(matrix, q=min(short, rank + _OVERSAMPLE),
                                    niter=_POWER_ITERATIONS)
    return u, s, v.mT


def chain_svd(tensor: Tensor, dims: Sequence[int], max_rank: int | Sequence[int] | None = None,
              tolerance: float | None = None) -> tuple[list[Tensor], float]:
    """Cores ``(r_{k-1}, dims[k], r_k)`` of ``tensor`` and the discarded Frobenius mass."""
    dims = [int(d) for d in dims]
    num = len(dims)
    if tensor.numel() != math.prod(dims):
        raise ValueError(
            f"tensor has {tensor.numel()} entries but dims {dims} need {math.prod(dims)}"
        )
    caps = internal_ranks(max_rank, num, "max_rank") if max_rank is not None else None
    if tolerance is not None and tolerance < 0:
        raise ValueError(f"tolerance must be >= 0 (relative Frobenius error), got {tolerance!r}")
    out_dtype = tensor.dtype
    with torch.no_grad():
        work = tensor.detach()
        if work.dtype in _SVD_UNSUPPORTED or not work.is_floating_point():
            work = work.to(torch.float32)
        delta = None
        if tolerance is not None and num > 1:
            delta = tolerance * float(torch.linalg.vector_norm(work)) / math.sqrt(num - 1)
        cores: list[Tensor] = []
        discarded_sq = 0.0
        rest = work.reshape(1, -1)
        r_prev = 1
        for k in range(num - 1):
            rest = rest.reshape(r_prev * dims[k], -1)
            if delta is None and caps is not None:
                u, s, vh = leading_svd(rest, caps[k])
            else:
                u, s, vh = torch.linalg.svd(rest, full_matrices=False)
            rank = s.numel()
            if delta is not None:
                # tail[i] = sqrt(sum_{j >= i} s_j^2): keep the fewest values with tail <= delta.
                tail = torch.flip(torch.cumsum(torch.flip(s.double() ** 2, [0]), 0), [0]).sqrt()
                rank = max(1, int((tail > delta).sum()))
            if caps is not None:
                rank = min(rank, caps[k])
            if s.numel() == min(rest.shape):  # the full spectrum: sum the tail exactly
                discarded_sq += float((s[rank:].double() ** 2).sum())
            else:  # randomized: what the kept subspace misses, ||A||^2 - sum(kept s^2)
                kept_sq = float((s[:rank].double() ** 2).sum())
                discarded_sq += max(0.0, float(rest.double().square().sum()) - kept_sq)
            cores.append(u[:, :rank].reshape(r_prev, dims[k], rank).to(out_dtype))
            rest = s[:rank, None] * vh[:rank]
            r_prev = rank
        cores.append(rest.reshape(r_prev, dims[-1], 1).to(out_dtype))
    return cores, math.sqrt(discarded_sq)
