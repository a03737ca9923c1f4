"""TT embedding bags the way recommenders use them: sparse tables, offsets, weights, padding.

Every bag result is checked against ``nn.EmbeddingBag`` built from the layer's own table
(``to_dense``), outputs and gradients; core gradients through the chain rule: the cores'
gradient must equal the dense table's gradient pulled back through ``to_dense``.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from torch import nn

import comera_compile as cc
import comera_compile.compile  # noqa: F401  (the lookup as one op under torch.compile)
from comera_compile.nn import TTEmbedding, tt_embedding
from comera_compile.planner.embedding import CHAIN
from tests.models import dlrm_batch, small_dlrm


def _random_gates(layer: TTEmbedding) -> None:
    with torch.no_grad():
        for gate in layer.gates:
            gate.uniform_(0.5, 1.5)


def _dense_twin(layer: TTEmbedding) -> nn.EmbeddingBag:
    return nn.EmbeddingBag.from_pretrained(
        layer.to_dense().detach().clone(),
        freeze=False,
        mode=layer.mode,
        include_last_offset=layer.include_last_offset,
        padding_idx=layer.padding_idx,
    )


def _pulled_back(layer: TTEmbedding, table_grad: torch.Tensor) -> list[torch.Tensor]:
    """d(loss)/d(cores, gates) given d(loss)/d(table): the chain rule through ``to_dense``."""
    layer.zero_grad()
    (layer.to_dense() * table_grad).sum().backward()
    grads = [p.grad.clone() for p in [*layer.cores, *layer.gates]]
    layer.zero_grad()
    return grads


def _force_split(layer: TTEmbedding, split: str) -> None:
    """Make every lookup use one strategy: the per-row chain or merged halves (bond 1)."""
    if split == "planned":
        return
    plan_for = layer.plan_for
    bond = CHAIN if split == "chain" else 1
    layer.plan_for = lambda rows: dataclasses.replace(plan_for(rows), split=bond)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("include_last_offset", [False, True])
@pytest.mark.parametrize("padding_idx", [None, 2])
@pytest.mark.parametrize("split", ["chain", "halves"])
def test_bag_matches_embedding_bag_outputs_and_grads(mode, include_last_offset, padding_idx, split):
    layer = TTEmbedding(
        600, 12, ranks=5, mode=mode, padding_idx=padding_idx,
        include_last_offset=include_last_offset,
    ).double()
    _random_gates(layer)
    with torch.no_grad():
        layer.gates[0][1] = 0.0  # one channel switched off: its gradient must be zero
    _force_split(layer, split)
    dense = _dense_twin(layer)
    ids = torch.tensor([4, 2, 4, 9, 599, 0, 2, 7, 7, 7, 31])
    offsets = torch.tensor([0, 3, 3, 6, 8])  # one empty bag, one bag of repeats
    if include_last_offset:
        offsets = torch.cat([offsets, torch.tensor([ids.numel()])])
    weight = torch.randn(5, 12, dtype=torch.float64)  # a loss that weighs every output
    out = layer(ids, offsets)
    expected = dense(ids, offsets)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    (out * weight).sum().backward()
    (expected * weight).sum().backward()
    got = [p.grad.clone() for p in [*layer.cores, *layer.gates]]
    for g, e in zip(got, _pulled_back(layer, dense.weight.grad), strict=True):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-10)
    assert float(got[len(layer.cores)][1]) == 0.0


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("bag", [1, 3])
def test_fixed_size_bags_match_embedding_bag_outputs_and_grads(mode, bag):
    """2-d input (one bag per row) takes the gather-and-sum pooling: same numbers."""
    layer = TTEmbedding(600, 12, ranks=5, mode=mode).double()
    _random_gates(layer)
    dense = _dense_twin(layer)
    ids = torch.tensor([4, 2, 4, 9, 599, 0, 2, 7, 7, 7, 31, 5])[: 4 * bag].reshape(-1, bag)
    weight = torch.randn(ids.shape[0], 12, dtype=torch.float64)
    out, expected = layer(ids), dense(ids)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    (out * weight).sum().backward()
    (expected * weight).sum().backward()
    got = [p.grad.clone() for p in [*layer.cores, *layer.gates]]
    for g, e in zip(got, _pulled_back(layer, dense.weight.grad), strict=True):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("include_last_offset", [False, True])
@pytest.mark.parametrize("split", ["chain", "halves"])
def test_per_sample_weights_match_embedding_bag(include_last_offset, split):
    layer = TTEmbedding(
        300, 8, ranks=4, mode="sum", padding_idx=5, include_last_offset=include_last_offset
    ).double()
    _random_gates(layer)
    _force_split(layer, split)
    dense = _dense_twin(layer)
    ids = torch.tensor([5, 1, 1, 299, 40, 5, 17])
    offsets = torch.tensor([0, 2, 5] + ([7] if include_last_offset else []))
    psw = torch.rand(ids.numel(), dtype=torch.float64, requires_grad=True)
    psw_dense = psw.detach().clone().requires_grad_()
    out, expected = layer(ids, offsets, psw), dense(ids, offsets, psw_dense)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    out.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    torch.testing.assert_close(psw.grad, psw_dense.grad, rtol=1e-10, atol=1e-10)
    got = [p.grad.clone() for p in [*layer.cores, *layer.gates]]
    for g, e in zip(got, _pulled_back(layer, dense.weight.grad), strict=True):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-10)


def test_chain_lookup_with_full_buckets_matches_the_table():
    """Many ids over few mode values: the chain's buckets hold many rows each (and uneven
    ones), outputs and core gradients still equal the dense table's."""
    layer = TTEmbedding(4_000, 16, ranks=[3, 7, 5], order=4, mode="sum").double()
    _random_gates(layer)
    _force_split(layer, "chain")
    dense = _dense_twin(layer)
    ids = torch.cat([torch.randint(0, 4_000, (300,)), torch.full((20,), 17)]).view(-1, 4)
    out, expected = layer(ids), dense(ids)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    out.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    got = [p.grad.clone() for p in [*layer.cores, *layer.gates]]
    for g, e in zip(got, _pulled_back(layer, dense.weight.grad), strict=True):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-10)


def test_lookup_builds_each_distinct_id_once():
    layer = TTEmbedding(10_000, 16, ranks=6, mode="sum")
    seen = []
    lookup = layer.lookup
    layer.lookup = lambda ids, **kw: seen.append(ids.numel()) or lookup(ids, **kw)
    ids = torch.tensor([[7, 7, 7, 9], [9, 7, 3, 3]])
    layer(ids)
    assert seen == [3]  # 8 ids, 3 distinct


def test_out_of_range_ids_rejected_eagerly_and_compiled():
    layer = TTEmbedding(997, 8, ranks=4, mode="sum")  # 997 rows: the chain has more
    assert layer.padded_shape[0] > 997
    with pytest.raises(IndexError, match=r"\[0, 997\).*\[3, 997\]"):
        layer(torch.tensor([[3, 997]]))
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    good = torch.tensor([[3, 996]])
    torch.testing.assert_close(compiled(good), layer(good))
    with pytest.raises(RuntimeError, match=r"ids must lie in \[0, 997\)"):
        compiled(torch.tensor([[3, 997]]))
    with pytest.raises(RuntimeError, match=r"ids must lie in \[0, 997\)"):
        compiled(torch.tensor([[-1, 4]]))


def _sparse_dlrm():
    """The test DLRM with ``sparse=True`` tables (its forward traces with torch.fx)."""
    torch.manual_seed(0)
    return small_dlrm((20_000, 1000, 500), dim=16, sparse=True)


def test_sparse_tables_are_tensorized_with_sparse_core_grads(monkeypatch):
    """A table declared sparse=True keeps sparse gradients: each core's holds only the
    slices the step read, equal to the dense gradient there, and Adagrad trains on them."""
    monkeypatch.setattr(tt_embedding, "SPARSE_CORE_MIN", 0)  # these small cores sparse too
    model = _sparse_dlrm()
    batch = dlrm_batch(model, batch=16)
    dense_out = model(*batch)
    dense_out.sum().backward()
    assert model.tables[0].weight.grad.is_sparse  # what the dense model trains with
    result = cc.optimize(model, "20x", example_inputs=batch, compile=False)
    layer = result.get_submodule("tables.0")
    assert isinstance(layer, TTEmbedding) and layer.declared_sparse
    assert model.tables[0].sparse  # the caller's model is untouched
    text = str(cc.summary(result))
    assert "tables.0: declared sparse=True; gradients stay sparse" in text
    target = torch.randn(16)
    twin = copy.deepcopy(result)
    twin.get_submodule("tables.0").declared_sparse = False  # the same table, dense gradients
    for m in (result, twin):
        (m(*batch) - target).pow(2).mean().backward()
    digits = batch[1][0].reshape(-1) // math.prod(layer.row_modes[1:])
    for got, want in zip(layer.cores, twin.get_submodule("tables.0").cores, strict=True):
        assert got.grad.is_sparse and not want.grad.is_sparse
        touched = got.grad.coalesce().indices()[0]
        assert touched.numel() <= batch[1][0].numel() < got.shape[0]  # slices read, no more
        torch.testing.assert_close(got.grad.to_dense(), want.grad, rtol=1e-5, atol=1e-7)
    assert set(layer.cores[0].grad.coalesce().indices()[0].tolist()) == set(digits.tolist())
    opt = torch.optim.Adagrad(result.parameters(), lr=0.01)
    losses = []
    for _ in range(8):
        loss = (result(*batch) - target).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_a_sparse_tables_small_cores_get_dense_gradients_and_its_large_ones_sparse():
    """Below SPARSE_CORE_MIN entries a core's gradient is dense (updated whole for less than
    a sparse one's per-slice updates); both equal the gradients of a dense-gradient twin."""
    torch.manual_seed(0)
    layer = TTEmbedding(200_000, 16, ranks=5, row_modes=[50, 4000], col_modes=[1, 16],
                        mode="sum", sparse=True).double()
    twin = copy.deepcopy(layer)
    twin.declared_sparse = False
    assert layer.sparse_cores() == (False, True)  # 250 entries; 320,000
    assert layer.sparse_parameters() == [layer.cores[1]]
    bags = torch.randint(0, 200_000, (32, 2))
    weight = torch.randn(32, 16, dtype=torch.float64)
    for m in (layer, twin):
        (m(bags) * weight).sum().backward()
    assert not layer.cores[0].grad.is_sparse and layer.cores[1].grad.is_sparse
    for got, want in zip(layer.cores, twin.cores, strict=True):
        grad = got.grad.to_dense() if got.grad.is_sparse else got.grad
        torch.testing.assert_close(grad, want.grad, rtol=1e-10, atol=1e-12)


def test_sparse_adam_on_tt_cores_names_the_fix():
    model = _sparse_dlrm()
    batch = dlrm_batch(model, batch=8)
    result = cc.optimize(model, "20x", example_inputs=batch, compile=False)
    opt = torch.optim.SparseAdam(list(result.get_submodule("tables.0").parameters()))
    result(*batch).sum().backward()
    with pytest.raises(RuntimeError, match=r"SparseAdam only takes sparse.*Adam, Adagrad or SGD"):
        opt.step()
    dense = nn.EmbeddingBag(50, 4, mode="sum", sparse=True)  # plain sparse tables still work
    sparse_opt = torch.optim.SparseAdam(dense.parameters())
    dense(torch.tensor([[1, 2]])).sum().backward()
    sparse_opt.step()


def test_include_last_offset_table_swaps_in():
    class Bags(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bag = nn.EmbeddingBag(5000, 16, mode="mean", include_last_offset=True)
            self.head = nn.Linear(16, 32)

        def forward(self, ids, offsets):
            return self.head(self.bag(ids, offsets))

    ids, offsets = torch.tensor([1, 2, 3, 4999]), torch.tensor([0, 1, 4])
    result = cc.optimize(Bags(), "4x", example_inputs=(ids, offsets), compile=False)
    bag = result.get_submodule("bag")
    assert isinstance(bag, TTEmbedding) and bag.include_last_offset
    assert result(ids, offsets).shape == (2, 32)


_TRAIN_10M_ROWS = """
import torch
from comera_compile.nn import TTEmbedding

def rss(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

rows = 10_000_000
layer = TTEmbedding(rows, 16, ranks=16, mode="sum")
opt = torch.optim.Adagrad(layer.parameters(), lr=0.01)
g = torch.Generator().manual_seed(0)

def step(bags, per_bag):
    ids = torch.randint(0, rows, (bags, per_bag), generator=g)
    loss = layer(ids).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()

for shape in ((1, 1), (256, 1), (4096, 4)):  # every lookup strategy, optimizer state made
    step(*shape)
before = rss("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
for shape in ((1, 1), (256, 1), (4096, 4), (1, 1)):
    step(*shape)
trained = rss("VmHWM") - before
canary = torch.ones(4_000_000, 4)  # 64 MB: proves the measurement sees an allocation
seen = rss("VmHWM") - before
print(trained, seen)
"""


@pytest.mark.slow
def test_training_a_10m_row_table_allocates_nothing_table_sized(tmp_path):
    """Forward, backward and Adagrad on a 10M x 16 table (640 MB dense) in a fresh process:
    the peak RSS during the steps must stay a small fraction of the table."""
    import os
    import subprocess
    import sys

    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux /proc/self/clear_refs to reset the peak RSS")
    script = tmp_path / "train_10m.py"
    script.write_text(_TRAIN_10M_ROWS)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    trained, seen = (int(v) for v in done.stdout.split()[-2:])
    table = 10_000_000 * 16 * 4
    assert seen > 32 * 2**20  # the 64 MB canary shows up (less what the peak already held)
    # 16,384 ids in the largest batch: ~20 MB of batch-sized work (sorts, gathers, their
    # gradients); the dense table alone would be 640 MB and its Adagrad state as much again.
    assert trained < table / 16, f"peak grew by {trained / 2**20:.1f} MB while training"


@pytest.mark.parametrize("kwargs, ids", [
    ({}, torch.randint(0, 64, (4, 40))),  # 160 ids, 64 rows: each row computed once
    ({"padding_idx": 3}, torch.randint(0, 64, (4, 40))),
    ({"mode": "sum"}, torch.randint(0, 64, (80, 2))),
    ({}, torch.randint(0, 64, (2, 8))),  # fewer ids than rows: each id's row
])
def test_compiled_lookup_matches_eager_whether_rows_or_ids_are_fewer(kwargs, ids):
    """Compiled (no ``unique``): with fewer rows than ids every row is computed once and
    the ids index it; outputs and gradients equal eager's."""
    from models import assert_compiled_gradients_match_eager

    from comera_compile.nn import TTEmbedding

    torch.manual_seed(0)
    layer = TTEmbedding(64, 24, ranks=4, **kwargs)
    expected = layer(ids)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(layer, backend="comera")(ids), expected)
    assert_compiled_gradients_match_eager(layer, ids)
