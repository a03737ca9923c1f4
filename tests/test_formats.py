"""Tests for comera_compile.formats: modes, ranks, TT/TTM-SVD, init variance, counts."""

from __future__ import annotations

import math

import pytest
import torch

from comera_compile.formats import (
    Factorization,
    choose_order,
    clip_ranks,
    core_params,
    dense_linear_macs,
    factorize,
    tt_linear_macs,
    tt_linear_modes,
    tt_linear_params,
    tt_random_cores,
    tt_svd,
    tt_svd_with_error,
    tt_to_dense,
    ttm_linear_macs,
    ttm_modes,
    ttm_params,
    ttm_random_cores,
    ttm_svd,
    ttm_svd_with_error,
    ttm_to_dense,
)


def _rand(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g, dtype=torch.float64)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(b))


# ---------------------------------------------------------------- factorize


@pytest.mark.parametrize(
    ("size", "order", "modes"),
    [(768, 3, (8, 8, 12)), (3072, 3, (12, 16, 16)), (32000, 4, (10, 10, 16, 20)), (64, 2, (8, 8))],
)
def test_factorize_exact(size: int, order: int, modes: tuple[int, ...]) -> None:
    f = factorize(size, order)
    assert f.modes == modes
    assert f.padding == 0 and f.padded == size


@pytest.mark.parametrize(("size", "order"), [(30522, 4), (1009, 2), (1009, 3)])
def test_factorize_pads_bad_sizes(size: int, order: int) -> None:
    f = factorize(size, order)
    assert 0 < f.padding <= 0.1 * size
    assert f.padded == math.prod(f.modes) and len(f.modes) == order
    assert list(f.modes) == sorted(f.modes)
    assert min(f.modes) > 1 and max(f.modes) <= 2 * f.padded ** (1 / order)
    assert factorize(size, order) == f  # deterministic


def test_factorize_edge_cases() -> None:
    assert factorize(1, 1) == Factorization(1, (1,))
    assert factorize(1, 3).modes == (1, 1, 1)
    assert factorize(1009, 1).modes == (1009,)
    assert factorize(2, 2).padded >= 2  # cannot be balanced: still returns something valid
    for bad in [(0, 2), (-3, 1), (10, 0), (10, -1)]:
        with pytest.raises(ValueError, match=">= 1"):
            factorize(*bad)


def test_choose_order() -> None:
    assert [choose_order(s) for s in (1, 15, 64, 768, 3072, 32000)] == [1, 1, 2, 3, 3, 4]


def test_reference_modes() -> None:
    def modes(pair: tuple[Factorization, Factorization]) -> tuple[list[int], list[int]]:
        return list(pair[0].modes), list(pair[1].modes)

    assert modes(tt_linear_modes(768, 768)) == ([12, 8, 8], [8, 8, 12])
    assert modes(tt_linear_modes(768, 3072)) == ([12, 8, 8], [12, 16, 16])
    assert modes(tt_linear_modes(3072, 768)) == ([16, 16, 12], [8, 8, 12])
    rows, cols = ttm_modes(32000, 768, 4)
    assert sorted(rows.modes) == [10, 10, 16, 20] and sorted(cols.modes) == [4, 4, 6, 8]
    rows, cols = ttm_modes(30522, 768)
    assert len(rows.modes) == len(cols.modes) == 4
    assert 0 < rows.padding <= 3052 and cols.padding == 0


def test_clip_ranks() -> None:
    assert clip_ranks([12, 8, 8, 8, 8, 12], 30) == [1, 12, 30, 30, 30, 12, 1]
    assert clip_ranks([12, 8, 8, 12, 16, 16], 30) == [1, 12, 30, 30, 30, 16, 1]
    assert clip_ranks([2, 3, 4], [100, 5]) == [1, 2, 4, 1]
    assert clip_ranks([7], 5) == [1, 1]
    with pytest.raises(ValueError, match="internal ranks"):
        clip_ranks([2, 3, 4], [1, 2, 3])


# ---------------------------------------------------------------- TT / TTM SVD

TT_SHAPES = [([4, 3], [2, 5]), ([6, 4, 2], [3, 4]), ([5], [3, 2, 2]), ([12, 8], [8, 12])]
TTM_SHAPES = [([4, 3], [2, 5]), ([3, 4, 2], [2, 2, 3]), ([10, 6, 4], [4, 2, 3])]


@pytest.mark.parametrize(("in_modes", "out_modes"), TT_SHAPES)
def test_tt_svd_full_rank_exact(in_modes: list[int], out_modes: list[int]) -> None:
    w = _rand(math.prod(in_modes), math.prod(out_modes))
    cores, err = tt_svd_with_error(w, in_modes, out_modes)
    assert _rel(tt_to_dense(cores, in_modes, out_modes), w) < 1e-6
    assert err < 1e-8 * float(torch.linalg.norm(w))
    assert all(c.dtype == torch.float64 for c in cores)


@pytest.mark.parametrize(("row_modes", "col_modes"), TTM_SHAPES)
def test_ttm_svd_full_rank_exact(row_modes: list[int], col_modes: list[int]) -> None:
    m = _rand(math.prod(row_modes), math.prod(col_modes))
    cores = ttm_svd(m, row_modes, col_modes)
    assert [c.shape[1:3] for c in cores] == list(zip(row_modes, col_modes))
    assert _rel(ttm_to_dense(cores, row_modes, col_modes), m) < 1e-6


def test_ttm_index_convention() -> None:
    # M[i1 i2, j1 j2] = G1[i1, j1] G2[i2, j2] with the first mode most significant.
    g = torch.Generator().manual_seed(3)
    cores = ttm_random_cores([3, 2], [2, 4], [1, 2, 1], 1.0, dtype=torch.float64, generator=g)
    m = ttm_to_dense(cores, [3, 2], [2, 4])
    i1, i2, j1, j2 = 2, 1, 1, 3
    expect = cores[0][0, i1, j1] @ cores[1][:, i2, j2, 0]
    assert torch.allclose(m[i1 * 2 + i2, j1 * 4 + j2], expect)


@pytest.mark.parametrize("tolerance", [0.3, 0.6])
def test_tt_svd_tolerance(tolerance: float) -> None:
    in_modes, out_modes = [6, 4, 2], [3, 4, 4]
    w = _rand(48, 48, seed=1)
    cores, bound = tt_svd_with_error(w, in_modes, out_modes, tolerance=tolerance)
    err = float(torch.linalg.norm(tt_to_dense(cores, in_modes, out_modes) - w))
    assert err <= bound + 1e-9
    assert err / float(torch.linalg.norm(w)) <= tolerance
    assert bound > 0  # it did truncate


def test_ttm_svd_tolerance_and_rank() -> None:
    row_modes, col_modes = [4, 5, 3], [3, 2, 4]
    m = _rand(60, 24, seed=2)
    cores, bound = ttm_svd_with_error(m, row_modes, col_modes, max_rank=4, tolerance=0.5)
    err = float(torch.linalg.norm(ttm_to_dense(cores, row_modes, col_modes) - m))
    assert err <= bound + 1e-9
    assert all(c.shape[0] <= 4 and c.shape[3] <= 4 for c in cores)


def test_tt_svd_max_rank() -> None:
    in_modes, out_modes = [12, 8], [8, 12]
    w = _rand(96, 96, seed=4)
    cores, bound = tt_svd_with_error(w, in_modes, out_modes, max_rank=5)
    assert [tuple(c.shape) for c in cores] == [(1, 12, 5), (5, 8, 5), (5, 8, 5), (5, 12, 1)]
    err = float(torch.linalg.norm(tt_to_dense(cores, in_modes, out_modes) - w))
    assert err <= bound + 1e-9
    cores = tt_svd(w, in_modes, out_modes, max_rank=[3, 7, 2])
    assert [c.shape[2] for c in cores] == [3, 7, 2, 1]


def test_low_rank_matrix_recovered_at_its_rank() -> None:
    g = torch.Generator().manual_seed(5)
    cores = tt_random_cores([4, 4], [4, 4], [1, 3, 2, 3, 1], 1.0, torch.float64, generator=g)
    w = tt_to_dense(cores, [4, 4], [4, 4])
    got = tt_svd(w, [4, 4], [4, 4], tolerance=1e-10)
    assert [c.shape[2] for c in got] == [3, 2, 3, 1]
    assert _rel(tt_to_dense(got, [4, 4], [4, 4]), w) < 1e-8


def test_shape_errors_name_the_fix() -> None:
    with pytest.raises(ValueError, match="pad"):
        tt_svd(_rand(10, 10), [3, 3], [2, 5])
    with pytest.raises(ValueError, match="ttm_modes"):
        ttm_svd(_rand(12, 10), [3, 4], [10])
    with pytest.raises(ValueError, match="clip_ranks"):
        tt_random_cores([2], [2], [1, 1], 1.0)


def test_half_precision_svd() -> None:
    w = _rand(12, 8).to(torch.bfloat16)
    cores = tt_svd(w, [3, 4], [2, 4])
    assert all(c.dtype == torch.bfloat16 for c in cores)
    assert _rel(tt_to_dense(cores, [3, 4], [2, 4]).double(), w.double()) < 0.05


# ---------------------------------------------------------------- random init


def test_tt_random_init_variance() -> None:
    sigma = math.sqrt(1 / (768 + 768))
    ranks = clip_ranks([12, 8, 8, 8, 8, 12], 30)
    variances = []
    for seed in range(32):
        g = torch.Generator().manual_seed(seed)
        cores = tt_random_cores([12, 8, 8], [8, 8, 12], ranks, sigma, torch.float64, generator=g)
        variances.append(float(tt_to_dense(cores, [12, 8, 8], [8, 8, 12]).pow(2).mean()))
    assert abs(sum(variances) / len(variances) / sigma**2 - 1) < 0.1


def test_ttm_random_init_variance() -> None:
    ranks = [1, 16, 16, 1]
    variances = []
    for seed in range(32):
        g = torch.Generator().manual_seed(seed)
        cores = ttm_random_cores([8, 8, 8], [4, 4, 4], ranks, 1.0, torch.float64, generator=g)
        variances.append(float(ttm_to_dense(cores, [8, 8, 8], [4, 4, 4]).pow(2).mean()))
    assert abs(sum(variances) / len(variances) - 1) < 0.1


# ---------------------------------------------------------------- counts


def test_reference_param_counts() -> None:
    assert tt_linear_params([12, 8, 8], [8, 8, 12], [1, 12, 30, 30, 30, 12, 1]) == 20448
    assert tt_linear_params([12, 8, 8], [12, 16, 16], [1, 12, 30, 30, 30, 16, 1]) == 28960
    assert tt_linear_params([16, 16, 12], [8, 8, 12], [1, 16, 30, 30, 30, 12, 1]) == 28960
    assert ttm_params([16, 20, 10, 10], [4, 4, 8, 6], [1, 32, 32, 32, 1]) == 167808
    assert core_params([(2, 3), (4,)]) == 10
    cores = tt_random_cores([12, 8, 8], [8, 8, 12], [1, 12, 30, 30, 30, 12, 1], 1.0)
    assert sum(c.numel() for c in cores) == 20448


def test_macs() -> None:
    ranks = [1, 12, 30, 30, 30, 12, 1]
    per_row = tt_linear_macs(1, [12, 8, 8], [8, 8, 12], ranks, include_merge=False)
    assert per_row == 30 * (768 + 768)  # ~46k vs 590k dense
    assert dense_linear_macs(1, 768, 768) == 589824
    merge = tt_linear_macs(0, [12, 8, 8], [8, 8, 12], ranks)
    # L: (12x12)@(12x240) then (96x30)@(30x240); R mirrored.
    assert merge == 2 * (12 * 12 * 8 * 30 + 96 * 30 * 8 * 30)
    assert tt_linear_macs(10, [12, 8, 8], [8, 8, 12], ranks) == merge + 10 * per_row
    ffn = tt_linear_macs(1, [12, 8, 8], [12, 16, 16], [1, 12, 30, 30, 30, 16, 1], False)
    assert ffn == 30 * (768 + 3072)
    # TTM sweep equals the direct product when every rank is 1.
    assert ttm_linear_macs(2, [3, 4], [5, 6], [1, 1, 1]) == 2 * (3 * 5 * 6 + 3 * 4 * 6)
    assert ttm_linear_macs(1, [4, 4], [4, 4], [1, 2, 1]) == 4 * 4 * 2 * 4 + 4 * 2 * 4 * 4


def test_chain_norm_is_the_norm_of_the_dense_tensor():
    from comera_compile.formats import chain_norm, tt_random_cores, tt_to_dense

    torch.manual_seed(0)
    cores = tt_random_cores([4, 5], [3, 6], [7, 3, 9], 0.3)
    dense = tt_to_dense(cores, [4, 5], [3, 6])
    assert chain_norm(cores) == pytest.approx(float(dense.norm()), rel=1e-5)
