"""Property tests (hypothesis) for the format math over random shapes and ranks:
factorizations cover their sizes, rank lists mean the same in every spelling, TT/TTM-SVD
round trips, the TT-SVD error bounds, and pruning dead rank channels leaves every layer's
output unchanged."""

from __future__ import annotations

import math

import pytest
import torch

from comera_compile.formats import (
    chain_ranks,
    clip_ranks,
    factorize,
    fit_ranks,
    internal_ranks,
    rank_caps,
    tt_linear_modes,
    tt_svd,
    tt_svd_with_error,
    tt_to_dense,
    ttm_modes,
    ttm_svd,
    ttm_svd_with_error,
    ttm_to_dense,
    zero_pad,
)
from comera_compile.nn import TTEmbedding, TTLinear, TTMLinear

hypothesis = pytest.importorskip(
    "hypothesis", reason="property tests need hypothesis: pip install 'comera_compile[dev]'")
st = pytest.importorskip("hypothesis.strategies")
given, settings = hypothesis.given, hypothesis.settings

FAST = settings(max_examples=25, deadline=None, database=None)  # fast, leaves no files
modes = st.lists(st.integers(1, 4), min_size=1, max_size=3)


def _matrix(rows: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=gen, dtype=torch.float64)


def _tail(matrix: torch.Tensor, rank: int) -> float:
    """Frobenius error of the best rank-``rank`` approximation (Eckart-Young)."""
    s = torch.linalg.svdvals(matrix)
    return float(s[rank:].square().sum().sqrt())


# ----- factorizations -------------------------------------------------------------------
@FAST
@given(size=st.integers(1, 5000), order=st.integers(1, 4))
def test_factorize_covers_size_within_padding(size, order):
    f = factorize(size, order)
    assert len(f.modes) == order and list(f.modes) == sorted(f.modes)
    assert f.padded == math.prod(f.modes)
    assert size <= f.padded <= max(size, math.floor(size * 1.1))
    assert factorize(size, order) == f


@FAST
@given(a=st.integers(1, 4000), b=st.integers(1, 4000), order=st.integers(1, 4))
def test_layer_modes_cover_both_sizes_with_one_order(a, b, order):
    for build in (tt_linear_modes, ttm_modes):
        first, second = build(a, b, order)
        assert first.padded >= a and second.padded >= b
        assert len(first.modes) == len(second.modes) == order
        assert list(first.modes) == sorted(first.modes, reverse=True)
        assert list(second.modes) == sorted(second.modes)


@FAST
@given(dims=st.lists(st.integers(1, 6), min_size=1, max_size=5), rank=st.integers(1, 40))
def test_clip_ranks_is_the_matricization_rank(dims, rank):
    ranks = clip_ranks(dims, rank)
    assert len(ranks) == len(dims) + 1 and ranks[0] == ranks[-1] == 1
    for k in range(1, len(dims)):
        assert ranks[k] == min(rank, math.prod(dims[:k]), math.prod(dims[k:]))


@FAST
@given(size=st.integers(1, 300), other=st.integers(1, 30), order=st.integers(1, 3))
def test_zero_padding_to_the_factorization_keeps_the_matrix(size, other, order):
    padded = factorize(size, order).padded
    w = _matrix(size, other, seed=size)
    out = zero_pad(w, padded, other + 1)
    assert out.shape == (padded, other + 1) and torch.equal(out[:size, :other], w)
    assert float(out.abs().sum()) == pytest.approx(float(w.abs().sum()))
    with pytest.raises(ValueError, match="zero-pad"):
        zero_pad(w, size - 1, other) if size > 1 else zero_pad(w, size, other - 1)


# ----- TT-SVD and TTM-SVD ---------------------------------------------------------------
@FAST
@given(in_modes=modes, out_modes=modes, seed=st.integers(0, 2**16))
def test_tt_svd_without_truncation_round_trips(in_modes, out_modes, seed):
    w = _matrix(math.prod(in_modes), math.prod(out_modes), seed)
    cores = tt_svd(w, in_modes, out_modes)
    torch.testing.assert_close(tt_to_dense(cores, in_modes, out_modes), w)


@FAST
@given(
    pairs=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 4)), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_ttm_svd_without_truncation_round_trips(pairs, seed):
    rows, cols = [m for m, _ in pairs], [n for _, n in pairs]
    w = _matrix(math.prod(rows), math.prod(cols), seed)
    torch.testing.assert_close(ttm_to_dense(ttm_svd(w, rows, cols), rows, cols), w)


@FAST
@given(
    in_modes=modes,
    out_modes=modes,
    rank=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_tt_svd_error_obeys_the_discarded_energy_bounds(in_modes, out_modes, rank, seed):
    """Oseledets: with eps_k the best rank-r_k error of the k-th unfolding of W,
    max_k eps_k <= ||W - W_tt|| <= sqrt(sum_k eps_k^2), and the reported error is the
    actual one."""
    dims = in_modes + out_modes
    w = _matrix(math.prod(in_modes), math.prod(out_modes), seed)
    cores, reported = tt_svd_with_error(w, in_modes, out_modes, max_rank=rank)
    actual = float(torch.linalg.norm(tt_to_dense(cores, in_modes, out_modes) - w))
    kept = [c.shape[-1] for c in cores[:-1]]
    eps = [_tail(w.reshape(math.prod(dims[: k + 1]), -1), r) for k, r in enumerate(kept)]
    slack = 1e-9 * float(torch.linalg.norm(w))
    assert all(r <= rank for r in kept)
    assert max(eps, default=0.0) <= actual + slack
    assert actual <= math.sqrt(sum(e * e for e in eps)) + slack
    assert abs(actual - reported) <= slack


@FAST
@given(
    pairs=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 4)), min_size=1, max_size=3),
    tolerance=st.floats(0.01, 0.9),
    seed=st.integers(0, 2**16),
)
def test_ttm_svd_meets_the_relative_tolerance(pairs, tolerance, seed):
    rows, cols = [m for m, _ in pairs], [n for _, n in pairs]
    w = _matrix(math.prod(rows), math.prod(cols), seed)
    cores, reported = ttm_svd_with_error(w, rows, cols, tolerance=tolerance)
    error = float(torch.linalg.norm(ttm_to_dense(cores, rows, cols) - w))
    assert error <= tolerance * float(torch.linalg.norm(w)) + 1e-12
    assert error == pytest.approx(reported, rel=1e-6, abs=1e-12)


# ----- pruning keeps outputs ------------------------------------------------------------
def _kill_channels(layer, data) -> list[int]:
    """Zero a random subset of each gate; return the live count per bond."""
    live = []
    with torch.no_grad():
        for gate in layer.gates:
            dead = data.draw(st.lists(st.booleans(), min_size=gate.numel(), max_size=gate.numel()))
            gate[torch.tensor(dead, dtype=torch.bool)] = 0.0
            live.append(gate.numel() - sum(dead))
    return live


@FAST
@given(
    kind=st.sampled_from([TTLinear, TTMLinear]),
    in_features=st.integers(2, 40),
    out_features=st.integers(2, 40),
    rank=st.integers(1, 5),
    data=st.data(),
)
def test_pruning_keeps_linear_outputs(kind, in_features, out_features, rank, data):
    torch.manual_seed(0)
    layer = kind(in_features, out_features, ranks=rank, order=2, dtype=torch.float64)
    live = _kill_channels(layer, data)
    x = torch.randn(3, in_features, dtype=torch.float64)
    before = layer(x)
    result = layer.prune_ranks()
    assert layer.ranks[1:-1] == [max(n, 1) for n in live]
    assert result.params_after == layer.num_core_parameters() <= result.params_before
    torch.testing.assert_close(layer(x), before)


@FAST
@given(
    num=st.integers(2, 60),
    dim=st.integers(2, 12),
    rank=st.integers(1, 5),
    data=st.data(),
)
def test_pruning_keeps_embedding_rows(num, dim, rank, data):
    torch.manual_seed(0)
    layer = TTEmbedding(num, dim, ranks=rank, order=2, dtype=torch.float64)
    live = _kill_channels(layer, data)
    ids = torch.arange(num)
    before = layer(ids)
    layer.prune_ranks()
    assert layer.ranks[1:-1] == [max(n, 1) for n in live]
    torch.testing.assert_close(layer(ids), before)


# ----- rank lists -----------------------------------------------------------------------
@FAST
@given(internal=st.lists(st.integers(1, 9), min_size=0, max_size=5))
def test_every_rank_spelling_means_the_same(internal):
    cores = len(internal) + 1
    assert internal_ranks(internal, cores) == internal
    assert internal_ranks([1, *internal, 1], cores) == internal
    assert chain_ranks(internal, cores) == [1, *internal, 1]
    if internal:
        assert internal_ranks(internal[0], cores) == [internal[0]] * len(internal)
    with pytest.raises(ValueError, match="internal ranks"):
        internal_ranks([*internal, 1, 1, 1], cores)


@FAST
@given(dims=st.lists(st.integers(1, 6), min_size=1, max_size=5), data=st.data())
def test_fit_ranks_takes_lists_within_the_caps_and_names_the_bonds_above(dims, data):
    caps = rank_caps(dims)
    fitting = [data.draw(st.integers(1, c)) for c in caps]
    assert fit_ranks(dims, fitting) == [1, *fitting, 1]
    assert fit_ranks(dims, 10**6) == clip_ranks(dims, 10**6) == [1, *caps, 1]
    if caps:
        bond = data.draw(st.integers(0, len(caps) - 1))
        too_big = [*fitting[:bond], caps[bond] + 1, *fitting[bond + 1 :]]
        with pytest.raises(ValueError, match=f"bond {bond + 1}: "):
            fit_ranks(dims, too_big)
