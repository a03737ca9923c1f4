"""Activation-aware decomposition: truncate what a layer's outputs feel, not its weight."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ._svd import chain_svd
from .ranks import internal_ranks
from .ttm import ttm_svd

DEFAULT_DAMPING = 0.001
TABLE_DAMPING = 1.0


def row_weights(frequencies: Tensor, damping: float = TABLE_DAMPING) -> Tensor:
    """Per table row, ``sqrt(f + damping * mean(f))`` (float64) for lookup frequencies ``f``:
    the diagonal whitening of an embedding table."""
    f = frequencies.detach().double().clamp_min(0)
    mean = float(f.mean()) if f.numel() else 0.0
    if not math.isfinite(mean) or mean <= 0:
        return torch.ones_like(f)
    return (f + max(damping, 1e-10) * mean).sqrt()


def weighted_lowrank_table(table: Tensor, frequencies: Tensor, rank: int,
                           damping: float = TABLE_DAMPING) -> tuple[Tensor, Tensor]:
    """``(A, B)`` with ``A @ B`` the rank-``rank`` table closest to ``table`` in the
    frequency-weighted norm (the output error of lookups at those frequencies)."""
    w = row_weights(frequencies, damping)[:, None]
    u, s, vh = torch.linalg.svd(w * table.double(), full_matrices=False)
    rank = min(rank, s.numel())
    left = (u[:, :rank] * s[:rank]) / w
    return left.to(table.dtype), vh[:rank].to(table.dtype)


def pad_gram(gram: Tensor, size: int) -> Tensor:
    """A ``(n, n)`` input Gram zero-padded to ``size`` (the padded inputs are always zero)."""
    n = gram.shape[0]
    if n == size:
        return gram
    out = gram.new_zeros(size, size)
    out[:n, :n] = gram
    return out


def gram_factor(gram: Tensor, damping: float = DEFAULT_DAMPING) -> Tensor:
    """Lower-triangular ``L`` (float64) with ``L L^T = G + damping * mean_eig(G) * I``."""
    g = gram.detach().double()
    g = 0.5 * (g + g.T)
    n = g.shape[0]
    scale = float(torch.diagonal(g).sum()) / max(n, 1)
    if not math.isfinite(scale) or scale <= 0:
        return torch.eye(n, dtype=torch.float64, device=g.device)
    shift = max(damping, 1e-10) * scale
    eye = torch.eye(n, dtype=torch.float64, device=g.device)
    for _ in range(8):
        factor, info = torch.linalg.cholesky_ex(g + shift * eye)
        if int(info) == 0:
            return factor
        shift *= 10
    return math.sqrt(scale) * eye


def whiten_tt_matrix(matrix: Tensor, gram: Tensor, damping: float = DEFAULT_DAMPING) -> Tensor:
    """``L^T M`` for ``M`` (``N_in x N_out``) and its input Gram: the matrix whose squared
    truncation error is the output's."""
    factor = gram_factor(pad_gram(gram, matrix.shape[0]), damping)
    return (factor.T @ matrix.double()).to(matrix.dtype)


def mode_gram_factors(gram: Tensor, modes: Sequence[int],
                      damping: float = DEFAULT_DAMPING) -> list[Tensor]:
    """Per input mode, the factor of the Gram's partial trace over the other modes."""
    modes = [int(m) for m in modes]
    g = pad_gram(gram.detach().double(), math.prod(modes)).reshape(*modes, *modes)
    d = len(modes)
    factors = []
    for k in range(d):
        others = [j for j in range(d) if j != k]
        perm = [k, *others, d + k, *(d + j for j in others)]
        rest = math.prod(modes) // modes[k]
        part = g.permute(perm).reshape(modes[k], rest, modes[k], rest)
        factors.append(gram_factor(torch.einsum("arbr->ab", part), damping))
    return factors


def _apply_modes(weight: Tensor, factors: Sequence[Tensor], modes: Sequence[int]) -> Tensor:
    """``weight (out x prod modes) @ (F_1 (x) ... (x) F_d)``, one mode at a time."""
    rows = weight.shape[0]
    t = weight.double().reshape(rows, *modes)
    for k, f in enumerate(factors):
        t = torch.movedim(torch.tensordot(t, f, dims=([k + 1], [0])), -1, k + 1)
    return t.reshape(rows, -1)


def whitened_tt_svd(matrix: Tensor, gram: Tensor, in_modes: Sequence[int], out_modes: Sequence[int],
                    max_rank: int | Sequence[int] | None = None,
                    damping: float = DEFAULT_DAMPING) -> list[Tensor]:
    """TT cores of ``M`` (``N_in x N_out``, padded) whose middle bond minimises the output
    error on inputs of Gram ``gram``; the other bonds are ordinary TT-SVD truncations."""
    in_modes, out_modes = [int(m) for m in in_modes], [int(m) for m in out_modes]
    d, e = len(in_modes), len(out_modes)
    caps = internal_ranks(max_rank, d + e, "max_rank") if max_rank is not None else None
    work = matrix.detach().double()
    factor = gram_factor(pad_gram(gram, work.shape[0]), damping)
    u, s, vh = torch.linalg.svd(factor.T @ work, full_matrices=False)
    r = s.numel() if caps is None else max(1, min(caps[d - 1], s.numel()))
    left = torch.linalg.solve_triangular(factor.T, u[:, :r], upper=True)  # L^{-T} U_r
    right = s[:r, None] * vh[:r]
    if d == 1:
        left_cores = [left.reshape(1, in_modes[0], r)]
    else:
        dims = [*in_modes[:-1], in_modes[-1] * r]
        left_cores, _ = chain_svd(left, dims, None if caps is None else caps[: d - 1])
        last = left_cores[-1]
        left_cores[-1] = last.reshape(last.shape[0], in_modes[-1], r)
    if e == 1:
        right_cores = [right.reshape(r, out_modes[0], 1)]
    else:
        dims = [r * out_modes[0], *out_modes[1:]]
        right_cores, _ = chain_svd(right, dims, None if caps is None else caps[d:])
        first = right_cores[0]
        right_cores[0] = first.reshape(r, out_modes[0], first.shape[-1])
    return [c.to(matrix.dtype) for c in (*left_cores, *right_cores)]


def whitened_ttm_svd(weight: Tensor, gram: Tensor, out_modes: Sequence[int],
                     in_modes: Sequence[int], max_rank: int | Sequence[int] | None = None,
                     damping: float = DEFAULT_DAMPING) -> list[Tensor]:
    """TTM cores ``(r, m_k, n_k, r')`` of ``W`` (``out x N_in``, padded) truncated in the
    Kronecker-whitened metric of ``gram``; the inverse factors fold into the input axes."""
    in_modes = [int(m) for m in in_modes]
    factors = mode_gram_factors(gram, in_modes, damping)
    whitened = _apply_modes(weight, factors, in_modes)
    cores = ttm_svd(whitened, out_modes, in_modes, max_rank=max_rank)
    out = []
    for core, f in zip(cores, factors):
        inverse = torch.linalg.inv(f)
        out.append(torch.einsum("amib,ij->amjb", core, inverse).to(weight.dtype))
    return out
