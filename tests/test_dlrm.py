"""The DLRM reference model and its synthetic click data (the benchmark's ground truth)."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from dlrm_model import DLRM, Adagrad, SyntheticClicks, auc, log_loss

import comera_compile as cc
from comera_compile.nn import TTEmbedding, TTLinear, tt_embedding

CARDS = (30_000, 5000, 40, 7)


def test_auc_matches_pairwise_count_with_ties():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 6, (40,), generator=g).float()  # many ties
    labels = torch.bernoulli(torch.full((40,), 0.4), generator=g)
    pos = [s for s, y in zip(scores, labels) if y > 0.5]
    neg = [s for s, y in zip(scores, labels) if y <= 0.5]
    pairs = [1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg)]
    assert auc(scores, labels) == pytest.approx(sum(pairs) / len(pairs), abs=1e-12)
    with pytest.raises(ValueError, match="both clicks and non-clicks"):
        auc(scores, torch.ones(40))


def test_clicks_are_deterministic_power_law_and_learnable():
    data = SyntheticClicks(CARDS)
    dense, sparse, labels = data.batch(4096, seed=3)
    again = data.batch(4096, seed=3)
    assert torch.equal(sparse, again[1]) and torch.equal(labels, again[2])
    assert sparse.shape == (4, 4096, 1)
    for t, rows in enumerate(CARDS):
        assert 0 <= int(sparse[t].min()) and int(sparse[t].max()) < rows
    counts = torch.bincount(sparse[0].flatten(), minlength=CARDS[0]).sort(descending=True).values
    assert counts[:300].sum() > 0.4 * 4096  # 1% of the ids take over 40% of the lookups
    assert 0.1 < labels.mean() < 0.4
    best = data.logit(dense, sparse)
    base = torch.full_like(labels, float(torch.logit(labels.mean())))
    assert log_loss(best, labels) < 0.85 * log_loss(base, labels)  # the signal is there
    assert auc(best, labels) > 0.8


def test_dlrm_is_traceable_and_its_sparse_tables_tensorize():
    torch.manual_seed(0)
    model = DLRM(CARDS, bottom=(32,), top=(32,))
    data = SyntheticClicks(CARDS, bag=2)
    dense, sparse, _ = data.batch(16, seed=0)
    assert model(dense, sparse).shape == (16,)
    result = cc.optimize(model, "10x", example_inputs=(dense, sparse), compile=False)
    report = cc.summary(result)
    assert report.capture_path == "fx"
    assert isinstance(result.get_submodule("tables.0"), TTEmbedding)
    assert not isinstance(result.get_submodule("tables.3"), TTEmbedding)  # 7 rows stay dense
    assert report.compression >= 10
    assert result(dense, sparse).shape == (16,)


@pytest.mark.parametrize("small_table", [Adagrad.SMALL_TABLE, 0])
def test_dlrm_built_on_meta_compresses_and_trains_with_adagrad(monkeypatch, small_table):
    """The DLRM's tables never exist densely: built on meta, tensorized, then one Adagrad
    (fused over dense gradients and small sparse tables densified, plain over larger sparse
    tables left dense) lowers the loss exactly as torch's own Adagrad does."""
    monkeypatch.setattr(Adagrad, "SMALL_TABLE", small_table)
    monkeypatch.setattr(tt_embedding, "SPARSE_CORE_MIN", 0)  # these small cores sparse too
    torch.manual_seed(0)
    data = SyntheticClicks(CARDS)
    with torch.device("meta"):
        model = DLRM(CARDS, bottom=(32,), top=(32,))
    example = tuple(x.to("meta") for x in data.batch(16, seed=0)[:2])
    model = cc.optimize(model, "10x", example_inputs=example, compile=False, inplace=True)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    twin = copy.deepcopy(model)
    ours, reference = Adagrad(model, lr=0.05), torch.optim.Adagrad(twin.parameters(), lr=0.05)
    # the smallest tables stay dense with sparse gradients, the TT tables' cores get sparse
    # ones too: the small among them are densified into the fused kernel
    left_dense = [t for t in model.tables if not isinstance(t, TTEmbedding)]
    assert len(left_dense) >= 1
    sparse_params = [p for t in model.tables for p in (
        t.sparse_parameters() if isinstance(t, TTEmbedding) else [t.weight])]
    assert len(sparse_params) > len(left_dense)
    small = [p for p in sparse_params if p.numel() <= small_table]
    assert len(ours.densified) == len(small)
    assert len(ours.optimizers) == 1 + (len(small) < len(sparse_params))
    dense, sparse, labels = data.batch(256, seed=1)
    for m, opt in [(model, ours), (twin, reference)]:
        losses = []
        for _ in range(5):
            loss = F.binary_cross_entropy_with_logits(m(dense, sparse), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        assert losses[-1] < losses[0]
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sparse", [True, False])
def test_small_sparse_tables_and_narrow_layers_stay_dense(sparse):
    """A sparse table under 262,144 entries and a Linear with at most 16 inputs or outputs
    stay dense by default, each with its reason; a dense-gradient table of the same size is
    tensorized, and ``include`` overrides both rules."""
    cards = (30_000, 2000, 7)  # 2000 x 16 = 32,000 entries
    data = SyntheticClicks(cards)
    with torch.device("meta"):
        model = DLRM(cards, bottom=(512,), top=(64,), sparse=sparse)
    example = tuple(x.to("meta") for x in data.batch(16, seed=0)[:2])
    result = cc.optimize(model, "8x", example_inputs=example, compile=False)
    skipped = cc.summary(result).skipped
    assert skipped["bottom.0"].startswith("narrow (13 -> 512)")  # 6,656 parameters
    assert skipped["bottom.2"].startswith("narrow (512 -> 16)")  # 8,192 parameters
    small = result.get_submodule("tables.1")
    if sparse:
        assert skipped["tables.1"].startswith("small sparse table (32,000 entries < 262,144)")
        assert not isinstance(small, TTEmbedding)
    else:
        assert isinstance(small, TTEmbedding)
    forced = cc.optimize(model, cc.CompressionConfig(budget="8x",
                                                     include=["tables.0", "tables.1", "bottom.0"]),
                         example_inputs=example, compile=False)
    assert isinstance(forced.get_submodule("tables.1"), TTEmbedding)
    assert isinstance(forced.get_submodule("bottom.0"), TTLinear)


def test_small_sparse_table_is_tensorized_when_the_budget_needs_it():
    cards = (20_000, 4000)  # the 64,000-entry table is held dense only if 30x is met without it
    data = SyntheticClicks(cards)
    with torch.device("meta"):
        model = DLRM(cards, bottom=(32,), top=(32,))
    example = tuple(x.to("meta") for x in data.batch(16, seed=0)[:2])
    loose = cc.optimize(model, "2x", example_inputs=example, compile=False)
    assert not isinstance(loose.get_submodule("tables.1"), TTEmbedding)
    assert cc.summary(loose).skipped["tables.1"].startswith("small sparse table")
    tight = cc.optimize(model, "30x", example_inputs=example, compile=False)
    assert isinstance(tight.get_submodule("tables.1"), TTEmbedding)
    assert cc.summary(tight).compression >= 30


class _OffsetsDLRM(torch.nn.Module):
    """A DLRM written as its reference code calls the tables: 1-d ids and offsets each."""

    def __init__(self, cards):
        super().__init__()
        self.bottom = torch.nn.Sequential(torch.nn.Linear(13, 32), torch.nn.ReLU(),
                                          torch.nn.Linear(32, 16))
        self.tables = torch.nn.ModuleList(
            torch.nn.EmbeddingBag(n, 16, mode="sum", sparse=True) for n in cards)
        self.top = torch.nn.Linear(16 * (len(cards) + 1), 1)

    def forward(self, dense, offsets, ids):
        pooled = [t(ids[k], offsets[k]) for k, t in enumerate(self.tables)]
        return self.top(torch.cat([self.bottom(dense), *pooled], 1)).squeeze(1)


def test_a_dlrm_calling_its_tables_with_offsets_compresses_caches_and_learns():
    """The reference call (``emb(ids, offsets)``, bags of one id and of several): the tables
    are tensorized with caches at 20x, the outputs equal the TT tables' own dense rows, and
    SGD lowers the loss on a planted signal."""
    torch.manual_seed(0)
    data = SyntheticClicks(CARDS, bag=2)

    def batch(n, seed):
        dense, sparse, labels = data.batch(n, seed=seed)
        ids = [s.reshape(-1) for s in sparse]  # bags of two ids
        offsets = [torch.arange(0, 2 * n, 2) for _ in sparse]
        return dense, offsets, ids, labels

    model = _OffsetsDLRM(CARDS)
    dense, offsets, ids, labels = batch(512, 99)
    result = cc.optimize(model, cc.CompressionConfig(budget=cc.Budget(ratio=20), compile=False,
                                                     row_cache=0.5, cache_warmup=5),
                         example_inputs=(dense, offsets, ids))
    big = result.tables[0]
    assert isinstance(big, TTEmbedding) and big.cache_rows > 0
    opt = torch.optim.SGD(cc.training.param_groups(result, lr=0.2, lr_cores=0.05), lr=0.2)
    losses = []
    for step in range(40):  # the caches fill after 5 steps
        dense, offsets, ids, labels = batch(256, step)
        loss = F.binary_cross_entropy_with_logits(result(dense, offsets, ids), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert big.cache_filled
    assert sum(losses[-5:]) < 0.9 * sum(losses[:5])
    with torch.no_grad():
        want = F.embedding_bag(ids[0], big.to_dense(), offsets[0], mode="sum")
        torch.testing.assert_close(big(ids[0], offsets[0]), want, rtol=1e-5, atol=1e-6)
        one = torch.arange(ids[0].numel())  # bags of one id each pass their rows through
        torch.testing.assert_close(big(ids[0], one), big.to_dense()[ids[0]], rtol=1e-5,
                                   atol=1e-6)
