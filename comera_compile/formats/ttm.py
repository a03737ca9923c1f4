"""TTM (tensor-train matrix) format: cores (r_{k-1}, m_k, n_k, r_k), one per mode pair."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ._checks import ttm_mode_pairs
from ._svd import chain_svd
from .ranks import chain_ranks
from .scaling import ttm_fan_ins
from .tt import check_chain, random_chain_cores


def ttm_svd_with_error(matrix: Tensor, row_modes: Sequence[int], col_modes: Sequence[int],
                       max_rank: int | Sequence[int] | None = None,
                       tolerance: float | None = None) -> tuple[list[Tensor], float]:
    """TTM-SVD of ``matrix`` plus the absolute Frobenius error bound of the truncation."""
    rows, cols = ttm_mode_pairs(row_modes, col_modes)
    n_rows, n_cols = math.prod(rows), math.prod(cols)
    if matrix.dim() != 2 or tuple(matrix.shape) != (n_rows, n_cols):
        raise ValueError(
            f"matrix has shape {tuple(matrix.shape)} but row_modes {rows} x col_modes {cols} "
            f"need ({n_rows}, {n_cols}); zero-pad it to the padded sizes of the Factorizations"
        )
    d = len(rows)
    # (m_1..m_d, n_1..n_d) -> (m_1, n_1, m_2, n_2, ...): each core owns one (m_k, n_k) pair.
    perm = [i for k in range(d) for i in (k, d + k)]
    tensor = matrix.reshape(*rows, *cols).permute(perm)
    cores, err = chain_svd(tensor, [m * n for m, n in zip(rows, cols)], max_rank, tolerance)
    shaped = [c.reshape(c.shape[0], m, n, c.shape[2]) for c, m, n in zip(cores, rows, cols)]
    return shaped, err


def ttm_svd(matrix: Tensor, row_modes: Sequence[int], col_modes: Sequence[int],
            max_rank: int | Sequence[int] | None = None,
            tolerance: float | None = None) -> list[Tensor]:
    """TTM cores of ``matrix`` (rows x cols), truncated by rank and/or relative error."""
    return ttm_svd_with_error(matrix, row_modes, col_modes, max_rank, tolerance)[0]


def ttm_to_dense(cores: Sequence[Tensor], row_modes: Sequence[int],
                 col_modes: Sequence[int]) -> Tensor:
    """Rebuild the (rows x cols) matrix by contracting the cores pairwise, left to right."""
    rows, cols = ttm_mode_pairs(row_modes, col_modes)
    check_chain(cores, list(zip(rows, cols)))
    acc = cores[0].reshape(cores[0].shape[1:])  # (M, N, r)
    for core in cores[1:]:
        big_m, big_n, r = acc.shape
        _, m, n, r_next = core.shape
        acc = (acc.reshape(big_m * big_n, r) @ core.reshape(r, m * n * r_next)).reshape(
            big_m, big_n, m, n, r_next
        )
        acc = acc.permute(0, 2, 1, 3, 4).reshape(big_m * m, big_n * n, r_next)
    return acc.reshape(acc.shape[0], acc.shape[1])


def ttm_random_cores(row_modes: Sequence[int], col_modes: Sequence[int], ranks: Sequence[int],
                     sigma: float, dtype: torch.dtype | None = None,
                     device: torch.device | str | None = None,
                     generator: torch.Generator | None = None,
                     fan_in_init: bool = False) -> list[Tensor]:
    """Random TTM cores with entry variance sigma^2; ``fan_in_init`` spreads the scale by
    each core's fan-in over ``col_modes`` (``formats.scaling``), else core k has std
    sigma^(1/d)/sqrt(r_k)."""
    rows, cols = ttm_mode_pairs(row_modes, col_modes)
    ranks = chain_ranks(ranks, len(rows))
    shapes = [(ranks[k], m, n, ranks[k + 1]) for k, (m, n) in enumerate(zip(rows, cols))]
    fan_ins = ttm_fan_ins(cols, ranks) if fan_in_init else None
    return random_chain_cores(shapes, sigma, dtype, device, generator, fan_ins)
