"""The C lookup of TT tables (planner.native_lookup): rows and every gradient equal the torch
form's (planner.gathered), with and without a cache, gates, sparse or dense core gradients;
gradients match finite differences; a table falls back to torch ops where it cannot run."""

import pytest
import torch

from comera_compile.nn import TTEmbedding
from comera_compile.nn.gates import hard_threshold
from comera_compile.nn.row_cache import split_by_cache
from comera_compile.planner import native_lookup
from comera_compile.planner.gathered import CachedChain, GatheredChain
from comera_compile.planner.lookup import mode_digits

pytestmark = pytest.mark.skipif(not native_lookup.available(),
                                reason="no C compiler to build the lookup")


def _cores(row_modes, col_modes, ranks, dtype):
    torch.manual_seed(0)
    return [torch.randn(m, r, n, r2, dtype=dtype, requires_grad=True)
            for m, n, r, r2 in zip(row_modes, col_modes, ranks[:-1], ranks[1:])]


def _lookup(runner, *args):
    """The C lookup under its C++ operator (autograd in C++) or its Python autograd node."""
    if runner == "operator":
        if native_lookup._operator() is None:
            pytest.skip("the C++ operator cannot be built here")
        return native_lookup.lookup(*args)
    return native_lookup.NativeLookup.apply(*args)


RUNNERS = ["node", "operator"]


def _dense(grad):
    return grad.to_dense() if grad is not None and grad.is_sparse else grad


SHAPES = [((5, 4, 3), (2, 2, 4), (1, 3, 4, 1), 14),
          ((7, 9), (4, 4), (1, 5, 1), 16),
          ((3, 2, 2, 5), (2, 3, 1, 2), (1, 2, 6, 3, 1), 9),
          ((11,), (6,), (1, 1), 5)]


@pytest.mark.parametrize("row_modes,col_modes,ranks,width", SHAPES)
@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("runner", RUNNERS)
def test_the_c_lookup_gives_the_torch_lookups_rows_and_gradients(row_modes, col_modes, ranks,
                                                                  width, cached, sparse,
                                                                  dtype, runner):
    cores = _cores(row_modes, col_modes, ranks, dtype)
    gates = [torch.rand(r, dtype=dtype, requires_grad=True) + 0.5 for r in ranks[1:-1]]
    rows = 1
    for m in row_modes:
        rows *= m
    ids = torch.randint(0, rows, (300,))
    ids[:5] = ids[5]  # repeats
    cache_ids = torch.full((8,), -1)
    chosen = torch.unique(ids)[: 6 if cached else 0]
    cache_ids[8 - chosen.numel():] = chosen
    weight = torch.randn(8, width, dtype=dtype, requires_grad=True)
    slots, hits, misses = split_by_cache(cache_ids, ids)
    digits = mode_digits(ids.index_select(0, misses), row_modes)
    order = len(cores)
    expected = CachedChain.apply(sparse, sparse, order, width, weight, slots, hits, misses,
                                 *digits, *cores, *gates)
    got = _lookup(runner, sparse, sparse, order, width, rows, 0.0, ids, cache_ids, weight,
                  *cores, *gates)
    if not cached:  # no cache at all, rather than one nothing hits
        expected_free = _lookup(runner, sparse, sparse, order, width, rows, 0.0, ids, None,
                                None, *cores, *gates)
        torch.testing.assert_close(expected_free, expected)
    torch.testing.assert_close(got, expected)
    upstream = torch.randn_like(got)
    leaves = [weight, *cores, *gates]
    want = torch.autograd.grad((expected * upstream).sum(), leaves, allow_unused=True)
    have = torch.autograd.grad((got * upstream).sum(), leaves, allow_unused=True)
    for w, h, leaf in zip(want, have, leaves, strict=True):
        assert (w is None) == (h is None)
        if w is not None:
            assert h.is_sparse == w.is_sparse, leaf.shape
            # float32: gradients summed over 300 ids in another order
            tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {}
            torch.testing.assert_close(_dense(h), _dense(w), **tol)


@pytest.mark.parametrize("runner", RUNNERS)
def test_the_c_lookups_gradients_match_finite_differences(runner):
    cores = _cores((3, 4, 2), (2, 3, 2), (1, 2, 3, 1), torch.float64)
    gates = [torch.rand(r, dtype=torch.float64, requires_grad=True) + 0.5 for r in (2, 3)]
    weight = torch.randn(4, 10, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([0, 5, 23, 5, 17, 2, 11, 23])
    cache_ids = torch.tensor([-1, -1, 5, 11])

    def rows(weight, *tensors):
        return _lookup(runner, False, False, 3, 10, 24, 0.0, ids, cache_ids, weight, *tensors)

    assert torch.autograd.gradcheck(rows, (weight, *cores, *gates))


@pytest.mark.parametrize("runner", RUNNERS)
def test_gates_at_or_under_the_threshold_switch_their_bond_off_with_no_gradient(runner):
    cores = _cores((5, 6), (4, 4), (1, 4, 1), torch.float64)
    gate = torch.tensor([0.5, 0.004, -0.3, -0.01], dtype=torch.float64, requires_grad=True)
    ids = torch.arange(30)
    got = _lookup(runner, False, False, 2, 16, 30, 0.01, ids, None, None, *cores, gate)
    digits = mode_digits(ids, (5, 6))
    shrunk = hard_threshold(gate, 0.01)
    want = GatheredChain.apply(False, 2, *digits, *cores, shrunk).reshape(30, 16)
    torch.testing.assert_close(got, want)
    upstream = torch.randn_like(got)
    have = torch.autograd.grad((got * upstream).sum(), [gate, *cores])
    expected = torch.autograd.grad((want * upstream).sum(), [gate, *cores])
    for h, e in zip(have, expected):
        torch.testing.assert_close(h, e)
    assert have[0][1] == 0 and have[0][3] == 0 and have[0][0] != 0  # switched off: no gradient


@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("runner", RUNNERS)
def test_ids_outside_the_table_are_refused_by_the_c_lookup(cached, runner):
    cores = _cores((4, 5), (2, 2), (1, 3, 1), torch.float32)
    cache_ids = torch.tensor([-1, 2, 7]) if cached else None
    weight = torch.randn(3, 4) if cached else None
    for bad, shown in (([3, 20, 7], r"\[3, 20\]"), ([-1, 4], r"\[-1, 4\]")):
        with pytest.raises(IndexError, match=r"ids must lie in \[0, 20\), got " + shown):
            _lookup(runner, False, False, 2, 4, 20, 0.0, torch.tensor(bad), cache_ids, weight,
                    *cores)
    table = TTEmbedding(20, 4, ranks=3, cache_rows=3 if cached else 0)
    if cached:
        table.fill_cache(torch.tensor([2, 7, 7]))
    with pytest.raises(IndexError, match=r"\[0, 20\)"):
        table(torch.tensor([[1, 20]]))


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("cache_rows", [0, 16])
@pytest.mark.parametrize("bag", [1, 3])
def test_a_table_looks_up_in_c_and_without_it_the_same_rows_and_gradients(monkeypatch, mode,
                                                                         cache_rows, bag):
    """Fixed bags are pooled in C (the rows never made); the same bags and gradients."""
    torch.manual_seed(0)
    table = TTEmbedding(1000, 12, ranks=4, mode=mode, sparse=True, cache_rows=cache_rows)
    if cache_rows:
        table.fill_cache(torch.arange(0, 1000, 7))
    ids = torch.randint(0, 1000, (64, bag))
    runs = []
    for native in (True, False):
        monkeypatch.setattr(native_lookup, "usable", lambda *a, native=native, **k: native)
        table.zero_grad(set_to_none=True)
        out = table(ids)
        (out * torch.arange(12.0)).sum().backward()
        runs.append((out.detach(), [_dense(p.grad) for p in table.parameters()]))
    (out_c, grads_c), (out_t, grads_t) = runs
    torch.testing.assert_close(out_c, out_t)
    for c, t in zip(grads_c, grads_t):
        assert (c is None) == (t is None)
        if c is not None:
            torch.testing.assert_close(c, t, rtol=1e-4, atol=1e-4)  # float32, summed in C


def test_lookups_the_c_loop_cannot_run_fall_back_to_torch_ops():
    cores = _cores((4, 4), (2, 2), (1, 3, 1), torch.float32)
    ids = torch.arange(8)
    assert native_lookup.usable(ids, cores, row_macs=12)
    assert not native_lookup.usable(ids, [c.to(torch.bfloat16) for c in cores], row_macs=12)
    assert not native_lookup.usable(ids, cores, row_macs=native_lookup.MAX_ROW_MACS + 1)
    assert not native_lookup.usable(ids, [c.to("meta") for c in cores], row_macs=12)
    half = torch.randn(4, 2, dtype=torch.float64)
    assert not native_lookup.usable(ids, cores, row_macs=12, cache_weight=half)


def test_two_libraries_loaded_from_memory_stay_two(tmp_path, monkeypatch):
    """Each library is loaded from its own in-memory file: a path the loader has seen (a
    reused /proc/self/fd/N) would hand back the library loaded first."""
    import os

    from comera_compile.planner import native

    monkeypatch.setenv("COMERA_CACHE_DIR", str(tmp_path / "cache"))
    libraries = []
    for value in (1, 2):
        source = tmp_path / f"lib{value}.c"
        source.write_text(f"int value_{value}(void) {{ return {value}; }}\n")
        command = lambda target, source=source: [os.environ.get("CC", "cc"), "-shared",  # noqa: E731
                                                 "-fPIC", str(source), "-o", str(target)]
        libraries.append(native.load(f"test{value}", native.build(f"test{value}", source,
                                                                  command)))
    assert libraries[0].value_1() == 1
    assert libraries[1].value_2() == 2
    assert not hasattr(libraries[1], "value_1")


def test_the_cache_index_follows_a_load_of_other_cached_ids():
    """The C lookup's hash index of the cached ids is built again after they change (a
    load here), so a lookup reads the rows the cache holds now."""
    torch.manual_seed(0)
    first = TTEmbedding(500, 8, ranks=3, mode="sum", cache_rows=4)
    first.fill_cache(torch.tensor([1, 2, 3, 4]))
    ids = torch.tensor([[1], [9], [300], [4]])
    first(ids)  # builds the index of [1, 2, 3, 4]
    second = TTEmbedding(500, 8, ranks=3, mode="sum", cache_rows=4)
    second.fill_cache(torch.tensor([9, 300, 301, 302]))
    with torch.no_grad():
        second.cache.weight.fill_(7.0)
    first.load_state_dict(second.state_dict())
    rows = first(ids)
    torch.testing.assert_close(rows[1:3], torch.full((2, 8), 7.0))  # 9 and 300: cached now
    torch.testing.assert_close(rows, second(ids))
