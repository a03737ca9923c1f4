"""TT-linear format: W (N_in x N_out) as a chain of cores, input modes first, then output."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ._checks import positive_ints
from ._svd import chain_svd
from .ranks import chain_ranks
from .scaling import fan_in_stds, tt_linear_fan_ins


def _check_matrix(matrix: Tensor, in_modes: Sequence[int], out_modes: Sequence[int]) -> None:
    n_in, n_out = math.prod(in_modes), math.prod(out_modes)
    if matrix.dim() != 2 or tuple(matrix.shape) != (n_in, n_out):
        raise ValueError(
            f"matrix has shape {tuple(matrix.shape)} but in_modes {in_modes} x out_modes "
            f"{out_modes} need ({n_in}, {n_out}); pass nn.Linear.weight.T and zero-pad it to "
            "the padded sizes of the Factorizations"
        )


def tt_svd_with_error(matrix: Tensor, in_modes: Sequence[int], out_modes: Sequence[int],
                      max_rank: int | Sequence[int] | None = None,
                      tolerance: float | None = None) -> tuple[list[Tensor], float]:
    """TT-SVD of ``matrix`` plus the absolute Frobenius error bound of the truncation."""
    in_modes = positive_ints("in_modes", in_modes)
    out_modes = positive_ints("out_modes", out_modes)
    _check_matrix(matrix, in_modes, out_modes)
    return chain_svd(matrix, in_modes + out_modes, max_rank, tolerance)


def tt_svd(matrix: Tensor, in_modes: Sequence[int], out_modes: Sequence[int],
           max_rank: int | Sequence[int] | None = None,
           tolerance: float | None = None) -> list[Tensor]:
    """TT-SVD (Oseledets): cores of ``matrix`` (N_in x N_out), truncated by rank and/or error."""
    return tt_svd_with_error(matrix, in_modes, out_modes, max_rank, tolerance)[0]


def merge_cores(cores: Sequence[Tensor]) -> Tensor:
    """Contract a chain of 3-way cores into a matrix (r_0 * prod n_k) x r_L, left to right."""
    acc = cores[0].reshape(-1, cores[0].shape[-1])
    for core in cores[1:]:
        r_prev, n, r_next = core.shape
        acc = (acc @ core.reshape(r_prev, n * r_next)).reshape(-1, r_next)
    return acc


def chain_norm(cores: Sequence[Tensor]) -> float:
    """Frobenius norm of the tensor a core chain represents, without building it: the
    chain of each core's Gram over its physical modes (cost linear in the modes)."""
    gram = torch.ones(1, 1, dtype=cores[0].dtype, device=cores[0].device)
    for core in cores:
        core = core.reshape(core.shape[0], -1, core.shape[-1])
        half = torch.tensordot(gram, core, dims=([0], [0]))  # (left', modes, right)
        gram = torch.tensordot(half, core, dims=([0, 1], [0, 1]))  # (right, right')
    return float(gram.reshape(-1).sum().clamp_min(0).sqrt())


def check_chain(cores: Sequence[Tensor], physical: Sequence[tuple[int, ...]]) -> None:
    """Core k must be ``(r_{k-1}, *physical[k], r_k)`` with ``r_0 = r_L = 1``."""
    if len(cores) != len(physical):
        raise ValueError(f"got {len(cores)} cores for {len(physical)} modes {list(physical)}")
    r_prev = 1
    for k, (core, phys) in enumerate(zip(cores, physical)):
        want = (r_prev, *phys)
        if core.dim() != len(want) + 1 or tuple(core.shape[:-1]) != want:
            expected = ", ".join(map(str, want))
            raise ValueError(
                f"core {k} has shape {tuple(core.shape)}; expected ({expected}, r_{k + 1})"
            )
        r_prev = core.shape[-1]
    if r_prev != 1:
        raise ValueError(f"last core must end with rank 1, got {r_prev}")


def tt_to_dense(cores: Sequence[Tensor], in_modes: Sequence[int],
                out_modes: Sequence[int]) -> Tensor:
    """Rebuild W (N_in x N_out) as L @ R, L = merged input cores, R = merged output cores."""
    in_modes = positive_ints("in_modes", in_modes)
    out_modes = positive_ints("out_modes", out_modes)
    check_chain(cores, [(n,) for n in in_modes + out_modes])
    d = len(in_modes)
    left = merge_cores(cores[:d])  # (N_in, r_d)
    right = merge_cores(cores[d:])  # (r_d * N_out, 1)
    return left @ right.reshape(left.shape[1], -1)


def random_chain_cores(shapes: Sequence[Sequence[int]], sigma: float,
                       dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                       generator: torch.Generator | None = None,
                       fan_ins: Sequence[int] | None = None) -> list[Tensor]:
    """Gaussian cores (last dim = right bond) whose chain product has entry variance sigma^2."""
    if sigma < 0:
        raise ValueError(f"sigma must be >= 0, got {sigma!r}")
    num = len(shapes)
    if fan_ins is not None:
        ranks = [1] + [int(s[-1]) for s in shapes]
        stds = fan_in_stds(fan_ins, ranks, sigma)
    else:
        stds = [sigma ** (1.0 / num) / math.sqrt(shape[-1]) for shape in shapes]
    cores = []
    for shape, std in zip(shapes, stds):
        core = torch.randn(tuple(shape), dtype=dtype, device=device, generator=generator)
        cores.append(core * std)
    return cores


def tt_random_cores(in_modes: Sequence[int], out_modes: Sequence[int], ranks: Sequence[int],
                    sigma: float, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None,
                    generator: torch.Generator | None = None,
                    fan_in_init: bool = False) -> list[Tensor]:
    """Random TT-linear cores with var(W_ij) = sigma^2; ``fan_in_init`` spreads the scale by
    each core's fan-in (``formats.scaling``), else core k has std sigma^(1/L)/sqrt(r_k)."""
    modes = positive_ints("in_modes", in_modes) + positive_ints("out_modes", out_modes)
    ranks = chain_ranks(ranks, len(modes))
    shapes = [(ranks[k], n, ranks[k + 1]) for k, n in enumerate(modes)]
    fan_ins = tt_linear_fan_ins(in_modes, ranks) if fan_in_init else None
    return random_chain_cores(shapes, sigma, dtype, device, generator, fan_ins)
