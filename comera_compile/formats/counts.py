"""Parameter and multiply-add counts, so layers and the planner can compare formats cheaply."""

from __future__ import annotations

import math
from collections.abc import Sequence

from ._checks import positive_ints, ttm_mode_pairs
from .ranks import chain_ranks


def core_params(shapes: Sequence[Sequence[int]]) -> int:
    """Total number of entries in cores of the given shapes."""
    return sum(math.prod(int(s) for s in shape) for shape in shapes)


def tt_linear_params(in_modes: Sequence[int], out_modes: Sequence[int],
                     ranks: Sequence[int]) -> int:
    """Parameters of a TT-linear chain: sum_k r_{k-1} n_k r_k (gates not included)."""
    modes = positive_ints("in_modes", in_modes) + positive_ints("out_modes", out_modes)
    ranks = chain_ranks(ranks, len(modes))
    return core_params([(ranks[k], n, ranks[k + 1]) for k, n in enumerate(modes)])


def ttm_params(row_modes: Sequence[int], col_modes: Sequence[int], ranks: Sequence[int]) -> int:
    """Parameters of a TTM chain: sum_k r_{k-1} m_k n_k r_k (gates not included)."""
    rows, cols = ttm_mode_pairs(row_modes, col_modes)
    ranks = chain_ranks(ranks, len(rows))
    return core_params([(ranks[k], m, n, ranks[k + 1]) for k, (m, n) in enumerate(zip(rows, cols))])


def dense_linear_macs(rows: int, in_features: int, out_features: int) -> int:
    """Multiply-adds of x (rows x in) @ W (in x out)."""
    return int(rows) * int(in_features) * int(out_features)


def tt_linear_macs(rows: int, in_modes: Sequence[int], out_modes: Sequence[int],
                   ranks: Sequence[int], include_merge: bool = True) -> int:
    """Multiply-adds of the reference TT-linear forward for ``rows`` input rows."""
    ins = positive_ints("in_modes", in_modes)
    outs = positive_ints("out_modes", out_modes)
    ranks = chain_ranks(ranks, len(ins) + len(outs))
    d = len(ins)
    n_in, n_out, r_mid = math.prod(ins), math.prod(outs), ranks[d]
    macs = int(rows) * r_mid * (n_in + n_out)
    if include_merge:
        left = 1  # rows of the running left product: prod of modes merged so far
        for k in range(d):
            if k > 0:
                macs += left * ranks[k] * ins[k] * ranks[k + 1]
            left *= ins[k]
        right = 1  # cols of the running right product
        for k in range(len(ranks) - 2, d - 1, -1):
            if k < len(ranks) - 2:
                macs += ranks[k] * outs[k - d] * ranks[k + 1] * right
            right *= outs[k - d]
    return macs


def ttm_linear_macs(rows: int, row_modes: Sequence[int], col_modes: Sequence[int],
                    ranks: Sequence[int]) -> int:
    """Multiply-adds of y = x @ M^T sweeping x (rows x prod n_k) through cores 1..d in turn."""
    ms, ns = ttm_mode_pairs(row_modes, col_modes)
    ranks = chain_ranks(ranks, len(ms))
    macs = 0
    for k in range(len(ms)):
        done_rows = math.prod(ms[:k])
        todo_cols = math.prod(ns[k + 1 :])
        macs += int(rows) * done_rows * todo_cols * ranks[k] * ns[k] * ms[k] * ranks[k + 1]
    return macs
