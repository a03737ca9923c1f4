"""A TT lookup's per-core contraction, bucketed or gathered: the same rows and gradients,
the faster of the two where they are close (timed once per shape), the one that moves far
fewer elements where they are not, and no trial under a caller's saved-tensor hooks."""

import pytest
import torch

from comera_compile.planner import lookup


def _cores(modes, cols, rank):
    torch.manual_seed(0)
    ranks = [1] + [rank] * (len(modes) - 1) + [1]
    return [torch.randn(modes[k], ranks[k], cols[k], ranks[k + 1], dtype=torch.float64,
                        requires_grad=True) for k in range(len(modes))]  # slices first


def test_both_contractions_give_the_same_rows_and_gradients():
    cores = _cores((7, 5, 6), (1, 2, 3), 4)
    ids = torch.tensor([0, 3, 17, 17, 209, 100, 5])
    outs = []
    for step in (lookup._contract_bucketed, lookup._contract_gathered):
        acc = cores[0][:, 0].index_select(0, torch.div(ids, 30, rounding_mode="floor"))
        digit = torch.remainder(torch.div(ids, 6, rounding_mode="floor"), 5)
        out = step(acc, cores[1], digit)
        grads = torch.autograd.grad(out.square().sum(), [cores[0], cores[1]])
        outs.append((out, grads))
    (a, ga), (b, gb) = outs
    torch.testing.assert_close(a, b)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y)


def test_a_clear_win_is_taken_without_a_trial_and_a_close_call_is_timed(monkeypatch):
    timed = []
    monkeypatch.setattr(lookup, "_measured", {})
    monkeypatch.setattr(lookup, "_time_contractions",
                        lambda acc, core, digit: timed.append(core.shape) or "gathered")
    few = torch.randn(8, 1, 16)  # 8 ids against a core of 4,000 slices: gather them
    chosen = lookup._faster_contraction(few, torch.randn(4000, 16, 16, 1),
                                        torch.zeros(8, dtype=torch.long))
    assert chosen is lookup._contract_gathered
    many = torch.randn(4096, 1, 50)  # 4,096 ids on 200 large slices: bucket them
    chosen = lookup._faster_contraction(many, torch.randn(200, 50, 1, 50),
                                        torch.zeros(4096, dtype=torch.long))
    assert chosen is lookup._contract_bucketed
    assert timed == []
    close = torch.randn(512, 1, 16)
    core = torch.randn(600, 16, 16, 1)
    assert lookup._faster_contraction(close, core, torch.zeros(512, dtype=torch.long)) is (
        lookup._contract_gathered)
    assert timed == [core.shape]
    lookup._faster_contraction(close[:300], core, torch.zeros(300, dtype=torch.long))
    assert len(timed) == 1  # 300 ids share 512's power-of-two bucket: measured once


def test_no_trial_runs_under_saved_tensor_hooks(monkeypatch):
    monkeypatch.setattr(lookup, "_measured", {})
    monkeypatch.setattr(lookup, "_time_contractions", lambda *a: (_ for _ in ()).throw(
        AssertionError("a trial under the caller's hooks")))
    close = torch.randn(512, 1, 16)
    core = torch.randn(600, 16, 16, 1)
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        lookup._faster_contraction(close, core, torch.zeros(512, dtype=torch.long))
    assert lookup._measured == {}  # the estimate served that call only


def test_a_lookup_of_no_ids_has_rows_of_the_right_width():
    cores = _cores((30, 20), (1, 16), 5)
    for ids in (torch.zeros(0, dtype=torch.long), torch.tensor([3, 599])):
        out = lookup.chain_lookup(ids, cores, (30, 20), (1, 16))
        out.sum().backward()
        assert out.shape == (ids.numel(), 16)


def test_sparse_core_gradients_equal_the_dense_ones_and_hold_only_the_slices_read():
    """Orders 1-4: the same rows, and each core's sparse gradient equals its dense one, with
    entries only for the digits the ids read (repeats included, summed when coalesced)."""
    shapes = [((60,), (8,)), ((6, 10), (2, 4)), ((3, 4, 5), (2, 2, 2)),
              ((2, 3, 2, 5), (1, 2, 2, 2))]
    ids = torch.tensor([0, 7, 7, 59, 31, 42, 7])
    for modes, cols in shapes:
        cores = _cores(modes, cols, 3)
        gates = [torch.rand(3, dtype=torch.float64) + 0.5 for _ in modes[1:]]
        weight = torch.randn(ids.numel(), torch.tensor(cols).prod().item(), dtype=torch.float64)
        dense = lookup.chain_lookup(ids, cores, modes, cols, gates)
        want = torch.autograd.grad((dense * weight).sum(), cores)
        sparse = lookup.chain_lookup(ids, cores, modes, cols, gates, sparse=True)
        torch.testing.assert_close(sparse, dense)
        (sparse * weight).sum().backward()
        rest = ids
        for k in reversed(range(len(modes))):
            digit, rest = torch.remainder(rest, modes[k]), torch.div(rest, modes[k],
                                                                     rounding_mode="floor")
            grad = cores[k].grad
            assert grad.is_sparse
            assert sorted(grad.coalesce().indices()[0].tolist()) == sorted(set(digit.tolist()))
            torch.testing.assert_close(grad.to_dense(), want[k])


@pytest.mark.parametrize("sparse", [False, True])
def test_a_lookup_under_autocast_computes_in_its_cores_dtype_both_ways(sparse):
    """The gathered nodes run with autocast off (rows in the cores' dtype, as nn.Embedding
    gives them), forward and backward, whether backward runs inside the autocast or not."""
    from comera_compile.nn import TTEmbedding

    torch.manual_seed(0)
    layer = TTEmbedding(600, 32, ranks=24, row_modes=[30, 20], col_modes=[4, 8], mode="sum",
                        sparse=sparse, dedup=False)
    ids = torch.randint(0, 600, (64, 3))
    want = layer(ids)
    grads = torch.autograd.grad(want.square().sum(), list(layer.cores))
    for inside in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = layer(ids)
            loss = got.square().sum()
            if inside:
                loss.backward()
        if not inside:
            loss.backward()
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want)
        for core, grad in zip(layer.cores, grads):
            dense = [g.to_dense() if g.is_sparse else g for g in (core.grad, grad)]
            torch.testing.assert_close(*dense)
            core.grad = None
