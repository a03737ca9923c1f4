"""TT embedding tables with a hot-row cache: exact against the same rows without it, sparse
cache gradients that plain optimizers take, the cached set chosen once and fixed, the budget
giving a cache only where ids are skewed, save / load, and a click task that learns."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from dlrm_model import DLRM, Adagrad, SyntheticClicks, log_loss
from torch import nn

import comera_compile as cc
from comera_compile.nn import TTEmbedding
from comera_compile.nn.row_cache import EMPTY, top_rows
from comera_compile.passes.row_cache import AUTO_SHARE, held_out_hit_rate


def _cached_table(mode="sum", cached=(3, 4, 7, 9, 31), **kwargs) -> TTEmbedding:
    torch.manual_seed(0)
    layer = TTEmbedding(600, 12, ranks=5, mode=mode, cache_rows=8, **kwargs).double()
    with torch.no_grad():
        for gate in layer.gates:
            gate.uniform_(0.5, 1.5)
    layer.fill_cache(torch.tensor(cached))
    with torch.no_grad():  # trained cache rows: no longer the cores' rows
        layer.cache.weight.add_(torch.randn_like(layer.cache.weight))
    return layer


def _twin(layer: TTEmbedding) -> nn.EmbeddingBag:
    return nn.EmbeddingBag.from_pretrained(
        layer.to_dense().detach().clone(), freeze=False, mode=layer.mode,
        include_last_offset=layer.include_last_offset, padding_idx=layer.padding_idx)


def _pulled_back(layer: TTEmbedding, table_grad: torch.Tensor) -> list[torch.Tensor]:
    """Gradients of cores, gates and cache given the table's: the chain rule through
    ``to_dense`` (cached rows come from the cache, the others from the cores)."""
    layer.zero_grad()
    (layer.to_dense() * table_grad).sum().backward()
    grads = [p.grad.clone() for p in [*layer.cores, *layer.gates, layer.cache.weight]]
    layer.zero_grad()
    return grads


def _grads(layer: TTEmbedding) -> list[torch.Tensor]:
    cache = layer.cache.weight.grad
    dense = [p.grad.to_dense() if p.grad.is_sparse else p.grad.clone()
             for p in [*layer.cores, *layer.gates]]
    return [*dense, cache.to_dense() if cache.is_sparse else cache.clone()]


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("padding_idx", [None, 4])
@pytest.mark.parametrize("include_last_offset", [False, True])
def test_cached_bags_match_the_table_outputs_and_grads(mode, padding_idx, include_last_offset):
    layer = _cached_table(mode, padding_idx=padding_idx, include_last_offset=include_last_offset,
                          sparse=True)
    dense = _twin(layer)
    ids = torch.tensor([4, 2, 4, 9, 599, 0, 2, 7, 7, 7, 31, 3])  # hits, misses, repeats
    offsets = torch.tensor([0, 3, 3, 6, 8] + ([12] if include_last_offset else []))
    weight = torch.randn(5, 12, dtype=torch.float64)
    out, expected = layer(ids, offsets), dense(ids, offsets)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    (out * weight).sum().backward()
    (expected * weight).sum().backward()
    assert layer.cache.weight.grad.is_sparse  # the table declared sparse=True
    for got, want in zip(_grads(layer), _pulled_back(layer, dense.weight.grad), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("mode", [None, "sum", "mean"])
def test_cached_rows_fixed_bags_and_weights_match_the_table(mode):
    layer = _cached_table(mode)
    twin = _twin(layer) if mode else nn.Embedding.from_pretrained(
        layer.to_dense().detach().clone(), freeze=False)
    ids = torch.tensor([[3, 5], [9, 9], [100, 7], [31, 4]])
    out, expected = layer(ids), twin(ids)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    out.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    assert not layer.cache.weight.grad.is_sparse  # sparse=False: a dense cache gradient
    for got, want in zip(_grads(layer), _pulled_back(layer, twin.weight.grad), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    if mode == "sum":  # per-sample weights over offsets
        flat, offsets = ids.flatten(), torch.tensor([0, 3, 5])
        psw = torch.rand(flat.numel(), dtype=torch.float64)
        torch.testing.assert_close(layer(flat, offsets, psw), twin(flat, offsets, psw),
                                   rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("chunk", [4096, 7])
def test_a_freshly_filled_cache_changes_nothing_and_reads_no_core_for_a_hit(chunk, monkeypatch):
    """Filled from the cores (whole, or ``chunk`` ids at a time, as a large cache is), the
    cached table equals the same cores without a cache; a batch of hits only gives the
    cores no gradient (a lookup never reads both)."""
    from comera_compile.nn import tt_embedding

    monkeypatch.setattr(tt_embedding, "FILL_CHUNK", chunk)
    torch.manual_seed(0)
    plain = TTEmbedding(5000, 16, ranks=6, mode="sum").double()
    cached = TTEmbedding(5000, 16, ranks=6, mode="sum", cache_rows=50).double()
    with torch.no_grad():
        for mine, theirs in zip([*cached.cores, *cached.gates], [*plain.cores, *plain.gates]):
            mine.copy_(theirs)
    ids = torch.randint(0, 5000, (64, 2))
    cached.fill_cache(ids[:20].flatten())
    torch.testing.assert_close(cached(ids), plain(ids), rtol=1e-12, atol=1e-12)
    hits = cached.cache.ids[cached.cache.ids != EMPTY][:6].view(3, 2)
    cached(hits).sum().backward()
    assert all(p.grad is None or not p.grad.any() for p in cached.cores)
    assert cached.cache.weight.grad.abs().sum() > 0


def test_fill_chooses_the_most_frequent_rows_once_and_warmup_counts_training_batches():
    assert top_rows(torch.tensor([5, 1, 5, 2, 2, 5, 9]), None, 2).tolist() == [2, 5]
    layer = TTEmbedding(1000, 8, ranks=4, mode="sum", cache_rows=3, cache_warmup=2)
    layer.eval()
    layer(torch.tensor([[7], [7], [7]]))  # eval batches are not counted
    layer.train()
    layer(torch.tensor([[1], [1], [2], [3], [1]]))
    assert not layer.cache_filled
    before = layer.lookup(torch.tensor([1, 2, 3, 4])).detach()
    layer(torch.tensor([[3], [2], [3], [4]]))
    assert layer.cache_filled
    assert layer.cache.ids.tolist() == [1, 2, 3]  # 1: three times, 3: twice, 2: twice
    torch.testing.assert_close(layer.lookup(torch.tensor([1, 2, 3, 4])), before)
    with pytest.raises(ValueError, match="set is fixed"):
        layer.fill_cache(torch.tensor([5]))
    with pytest.raises(ValueError, match="exceeds the table"):
        TTEmbedding(10, 8, ranks=2, cache_rows=11)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "dlrm_adagrad"])
def test_sparse_cache_gradients_train_with_plain_optimizers(optimizer):
    """SGD and Adagrad take the cache's sparse gradient as they take a sparse table's: the
    update equals the same step on a dense twin of the cached rows."""
    layer = _cached_table("sum", sparse=True).float()
    twin = copy.deepcopy(layer)
    ids = torch.tensor([[3], [4], [500], [9], [3]])
    model = nn.Sequential(layer)
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.5),
            "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.5),
            "dlrm_adagrad": None}[optimizer]
    opt = Adagrad(model, lr=0.5) if make is None else make(model.parameters())
    twin_opt = (torch.optim.Adagrad if optimizer != "sgd" else torch.optim.SGD)(
        twin.parameters(), lr=0.5)
    for m, o in ((layer, opt), (twin, twin_opt)):
        loss = m(ids).pow(2).sum()
        o.zero_grad()
        loss.backward()
        if m is twin:
            twin.cache.weight.grad = twin.cache.weight.grad.to_dense()
        o.step()
    torch.testing.assert_close(layer.cache.weight, twin.cache.weight)
    untouched = ~torch.isin(layer.cache.ids, ids.flatten())
    torch.testing.assert_close(layer.cache.weight[untouched], twin.cache.weight[untouched])


CARDS = (40_000, 30_000, 40)


def _optimized(ids_kind="power", row_cache="auto", budget="40x"):
    data = SyntheticClicks(CARDS)
    with torch.device("meta"):
        model = DLRM(CARDS, bottom=(32,), top=(32,))
    dense, sparse, _ = data.batch(2048, seed=5)
    if ids_kind == "uniform":
        sparse = torch.stack([torch.randint(0, n, sparse.shape[1:]) for n in CARDS])
    config = cc.CompressionConfig(budget=budget, compile=False, row_cache=row_cache,
                                  cache_warmup=3)
    return cc.optimize(model, config, example_inputs=(dense.to("meta"), sparse), inplace=True)


def test_the_budget_gives_a_cache_to_skewed_tables_and_none_to_uniform_ones():
    skewed, uniform = _optimized("power"), _optimized("uniform")
    for model in (skewed, uniform):
        report = cc.summary(model)
        assert report.compression >= 40 * 0.999  # the caches are counted in the budget
    for name in ("tables.0", "tables.1"):
        table = skewed.get_submodule(name)
        assert table.cache_rows > 0
        share = table.cache.weight.numel() / sum(p.numel() for p in table.parameters())
        assert abs(share - AUTO_SHARE) < 0.1  # the cores take the rank that fits the rest
        assert "hot-row cache" in cc.summary(skewed).notes[name]
        assert uniform.get_submodule(name).cache_rows == 0
        assert "close to uniform" in cc.summary(uniform).notes[name]
    forced = _optimized("uniform", row_cache=0.25)
    assert forced.get_submodule("tables.0").cache_rows > 0
    off = _optimized("power", row_cache=0)
    assert off.get_submodule("tables.0").cache_rows == 0


def test_held_out_hit_rate_tells_skewed_from_uniform_ids():
    g = torch.Generator().manual_seed(0)
    uniform = torch.randint(0, 1_000_000, (4096,), generator=g)
    skewed = SyntheticClicks((1_000_000,)).ids(0, (4096,), g)
    assert held_out_hit_rate(uniform, 10_000) < 0.01
    assert held_out_hit_rate(skewed, 10_000) > 0.3


def test_cached_model_saves_and_loads_exactly(tmp_path):
    model = _optimized()
    data = SyntheticClicks(CARDS)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(5):  # past the warm-up: the caches are filled and trained
        dense, sparse, labels = data.batch(128, seed=step)
        loss = F.binary_cross_entropy_with_logits(model(dense, sparse), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert model.get_submodule("tables.0").cache_filled
    cc.save(model, tmp_path)
    back = cc.load(tmp_path, model=DLRM(CARDS, bottom=(32,), top=(32,)))
    assert back.get_submodule("tables.0").cache_filled
    for key, value in model.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key
    dense, sparse, _ = data.batch(64, seed=99)
    model.eval(), back.eval()
    assert torch.equal(model(dense, sparse), back(dense, sparse))


def test_compiled_cached_model_matches_eager():
    model = _optimized()
    data = SyntheticClicks(CARDS)
    for table in (model.tables[0], model.tables[1]):
        table.fill_cache(data.batch(512, seed=7)[1][0 if table is model.tables[0] else 1])
    compiled = torch.compile(copy.deepcopy(model), backend="comera")
    dense, sparse, labels = data.batch(64, seed=3)
    eager_out, compiled_out = model(dense, sparse), compiled(dense, sparse)
    torch.testing.assert_close(compiled_out, eager_out, rtol=1e-5, atol=1e-6)
    F.binary_cross_entropy_with_logits(eager_out, labels).backward()
    F.binary_cross_entropy_with_logits(compiled_out, labels).backward()
    got = compiled._orig_mod.tables[0].cache.weight.grad
    want = model.tables[0].cache.weight.grad
    torch.testing.assert_close(got.to_dense(), want.to_dense(), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_planted_click_task_cached_loss_within_one_percent_of_dense():
    """The same steps of SGD on the same click stream (a planted signal): the compressed
    model with cached tables learns it (well under the constant-rate loss) and ends within
    1% of the dense model's held-out loss."""
    cards = (200_000, 100_000, 50)
    data = SyntheticClicks(cards)
    held = data.batch(8192, seed=10**6)
    ctr = held[2].mean()
    constant = log_loss(torch.full_like(held[2], float(torch.logit(ctr))), held[2])
    losses = {}
    for row in ("dense", "cached"):
        torch.manual_seed(0)
        model = DLRM(cards, bottom=(64,), top=(64,))
        if row == "cached":
            dense, sparse, _ = data.batch(4096, seed=10**6 + 1)
            config = cc.CompressionConfig(budget="20x", compile=False, cache_warmup=20,
                                          exclude=["bottom.*", "top.*"])
            model = cc.optimize(model, config, example_inputs=(dense, sparse))
            assert model.tables[0].cache_rows > 0 and model.tables[1].cache_rows > 0
        with torch.no_grad():  # rows start small (N(0, 1) rows swamp the interactions)
            for table in model.tables:
                last = table.cores[-1] if isinstance(table, TTEmbedding) else table.weight
                last.mul_(0.1)
        groups = (cc.training.param_groups(model, lr=0.3, lr_cores=0.05,
                                                 lr_gates=0.05) if row == "cached"
                  else model.parameters())
        opt = torch.optim.SGD(groups, lr=0.3)
        for step in range(300):
            dense, sparse, labels = data.batch(512, seed=step)
            loss = F.binary_cross_entropy_with_logits(model(dense, sparse), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            losses[row] = log_loss(model(held[0], held[1]), held[2])
    assert losses["dense"] < 0.95 * constant, (losses, constant)  # the signal is learned
    assert losses["cached"] <= losses["dense"] * 1.01, losses


@pytest.mark.parametrize("sparse", [False, True])
def test_a_cached_lookup_rebuilt_in_backward_equals_the_one_node_lookup(sparse):
    """With ``recompute_lookup`` (bond recomputation) a cached table's misses go through the
    recomputed lookup and ``Interleave``; rows and every gradient equal ``CachedChain``'s."""
    layer = _cached_table(sparse=sparse)
    ids = torch.tensor([[3, 5], [7, 100], [31, 3], [599, 0]])
    weight = torch.randn(4, 12, dtype=torch.float64)
    results = []
    for recompute in (False, True):
        layer.recompute_lookup = recompute
        out = layer(ids)
        grads = torch.autograd.grad((out * weight).sum(), list(layer.parameters()))
        results.append((out, [g.to_dense() if g.is_sparse else g for g in grads]))
    (a, grads_a), (b, grads_b) = results
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for x, y in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)
