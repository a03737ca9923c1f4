"""BTTLinear and format="btt": the math against an independent dense build, gradients,
counts, init and learning rates, pruning, checkpoints, the backend and optimize's budget."""

from __future__ import annotations

import copy
import math

import hf_models
import pytest
import torch
from torch import nn

import comera_compile as cc
from comera_compile.formats import btt_modes
from comera_compile.passes.specs import LayerSpec
from comera_compile.training import param_groups, prune_model


def dense_of(layer: cc.BTTLinear) -> torch.Tensor:
    """``x @ W`` weight of the (padded) layer, built block by block: block ``(i1, a0)`` is
    ``A[i1, :, a0, :] @ B[a0, i1]`` with the gate on the bond (not the layer's code)."""
    a, b = layer.cores
    gate = torch.where(layer.gates[0].abs() > layer.threshold, layer.gates[0],
                       torch.zeros_like(layer.gates[0]))
    (m1, m0), (n0, n1) = layer.in_modes, layer.out_modes
    w = torch.zeros(m1, m0, n0, n1, dtype=a.dtype)
    for i1 in range(m1):
        for a0 in range(n0):
            left = a[0, i1, :, a0, :] * gate  # (m0, r)
            right = b[:, a0, i1, :, 0]  # (r, n1)
            w[i1, :, a0, :] = left @ right
    return w.reshape(m1 * m0, n0 * n1)[: layer.in_features, : layer.out_features]


@pytest.mark.parametrize("sizes,rank", [((24, 40), 3), ((30, 50), 2), ((97, 64), 4)])
def test_forward_equals_the_blockwise_dense_weight(sizes, rank):
    torch.manual_seed(0)
    layer = cc.BTTLinear(*sizes, ranks=rank).double()
    x = torch.randn(3, 5, sizes[0], dtype=torch.float64)
    expected = x @ dense_of(layer) + layer.bias
    torch.testing.assert_close(layer(x), expected)
    torch.testing.assert_close(layer.to_dense(), dense_of(layer).T)


def test_gradients_match_the_dense_equivalent():
    torch.manual_seed(1)
    layer = cc.BTTLinear(24, 40, ranks=3).double()
    with torch.no_grad():
        layer.gates[0].copy_(torch.tensor([0.5, 1.5, -2.0]))
    x = torch.randn(7, 24, dtype=torch.float64, requires_grad=True)
    target = torch.randn(7, 40, dtype=torch.float64)
    (layer(x) - target).square().sum().backward()
    got = [p.grad.clone() for p in (*layer.cores, layer.gates[0], layer.bias)] + [x.grad.clone()]
    for p in layer.parameters():
        p.grad = None
    x.grad = None
    (x @ dense_of(layer) + layer.bias - target).square().sum().backward()
    want = [p.grad for p in (*layer.cores, layer.gates[0], layer.bias)] + [x.grad]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_parameter_count_is_the_formula():
    layer = cc.BTTLinear(384, 1024, ranks=3)
    (m1, m0), (n0, n1) = layer.in_modes, layer.out_modes
    assert (m1, m0, n0, n1) == (24, 16, 32, 32)  # the reference's most even factors
    r = 3
    cores = r * (m1 * m0 * n0 + n0 * m1 * n1)
    assert layer.num_core_parameters() == cores == 3 * (384 * 32 + 1024 * 24)
    total = sum(p.numel() for p in layer.parameters())
    assert total == cores + r + 1024  # cores, one gate entry per rank, bias
    spec = LayerSpec("btt", 384, 1024, layer.in_modes, layer.out_modes, (1, 3, 1), True)
    assert spec.params == total
    assert spec.macs_per_row() == cores
    assert layer.compression_ratio() == pytest.approx(384 * 1024 / cores)


def test_rank_is_clipped_where_btt_holds_every_matrix():
    layer = cc.BTTLinear(64, 64, ranks=100)
    assert layer.ranks == [1, 8, 1]  # min(m0, n1)
    with pytest.raises(ValueError, match="two in_modes"):
        cc.BTTLinear(64, 64, in_modes=(4, 4, 4))


def test_init_stds_follow_each_core_fan_in_and_lrs_its_share():
    torch.manual_seed(0)
    layer = cc.BTTLinear(256, 1024, ranks=4, bias=False)
    (m1, m0), (n0, n1) = layer.in_modes, layer.out_modes
    r = 4
    # muP (the reference): std = sqrt(1 / d_in) * min(1, sqrt(d_out / d_in)) per core
    want = [math.sqrt(1 / m0) * min(1, math.sqrt(n0 * r / m0)),
            math.sqrt(1 / (r * m1)) * min(1, math.sqrt(n1 / (r * m1)))]
    for core, std in zip(layer.cores, want):
        assert float(core.detach().std()) == pytest.approx(std, rel=0.05)
    groups = param_groups(layer, lr=1e-3)
    rates = {id(p): g["lr"] for g in groups for p in g["params"]}
    # the reference's lr_mult: d_in / d_in_k / number of cores
    assert rates[id(layer.cores[0])] == pytest.approx(1e-3 * 256 / m0 / 2, rel=1e-3)
    assert rates[id(layer.cores[1])] == pytest.approx(1e-3 * 256 / (r * m1) / 2, rel=1e-3)
    assert rates[id(layer.gates[0])] == pytest.approx(1e-2)


def test_from_dense_is_exact_at_full_rank_and_the_best_per_block_below():
    torch.manual_seed(0)
    dense = nn.Linear(24, 40).double()
    full = cc.BTTLinear.from_dense(dense)
    torch.testing.assert_close(full.to_dense(), dense.weight)
    cut = cc.BTTLinear.from_dense(dense, ranks=2)
    (m1, m0), (n0, n1) = cut.in_modes, cut.out_modes
    w = dense.weight.detach().T.reshape(m1, m0, n0, n1).permute(0, 2, 1, 3)
    tail = torch.linalg.svdvals(w)[..., 2:].square().sum().sqrt()  # Eckart-Young per block
    err = (cut.to_dense() - dense.weight).norm()
    torch.testing.assert_close(err, tail)
    tolerance = float(tail) / float(dense.weight.detach().norm()) + 1e-9
    assert cc.BTTLinear.from_dense(dense, tolerance=tolerance).ranks == [1, 2, 1]


def test_pruning_shrinks_both_cores_and_keeps_the_outputs():
    torch.manual_seed(0)
    layer = cc.BTTLinear(48, 80, ranks=5)
    opt = torch.optim.AdamW(layer.parameters())
    x = torch.randn(6, 48)
    layer(x).square().mean().backward()
    opt.step()
    with torch.no_grad():
        layer.gates[0][torch.tensor([1, 3])] = 0.0
    before = layer(x)
    results = prune_model(layer, opt)
    assert results[""].removed == [2]
    assert layer.ranks == [1, 3, 1]
    assert layer.cores[0].shape[-1] == 3 and layer.cores[1].shape[0] == 3
    torch.testing.assert_close(layer(x), before)
    layer(x).square().mean().backward()  # the optimizer's state was sliced with the cores
    opt.step()
    assert layer.num_core_parameters() == 3 * (48 * layer.out_modes[0]
                                                + 80 * layer.in_modes[0])


def test_backend_traces_without_a_graph_break_and_equals_eager():
    torch.manual_seed(0)
    layer = cc.BTTLinear(30, 50, ranks=3)
    x = torch.randn(4, 30)
    explained = torch._dynamo.explain(layer)(x)
    assert explained.graph_break_count == 0
    compiled = torch.compile(layer, backend="comera")
    torch.testing.assert_close(compiled(x), layer(x))
    torch._dynamo.reset()


def _llama_budget(fmt: str, budget: float):
    build, inputs, loss_fn = hf_models.llama()
    torch.manual_seed(0)
    model = build()
    out = cc.optimize(model, budget=budget, format=fmt, example_inputs=inputs)
    return model, out, inputs, loss_fn


def test_optimize_meets_the_budget_on_llama_and_saves_and_loads(tmp_path):
    model, out, inputs, loss_fn = _llama_budget("btt", 0.5)
    before = sum(p.numel() for p in model.parameters())
    after = sum(p.numel() for p in out.parameters())
    assert 0.4 * before <= after <= 0.5 * before
    assert any(isinstance(m, cc.BTTLinear) for m in out.modules())
    assert {"btt"} <= {r["format"] for r in cc.summary(out).records}
    loss_fn(out(**inputs).logits).backward()
    out.eval()
    cc.save(out, tmp_path)
    loaded = cc.load(tmp_path)
    loaded.eval()
    torch.testing.assert_close(loaded(**inputs).logits, out(**inputs).logits, rtol=0, atol=0)


def test_optimize_meets_the_budget_on_a_transformer_encoder():
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0, batch_first=True), 2)
    x = torch.randn(2, 10, 64)
    out = cc.optimize(enc, budget=0.5, format="btt", example_inputs=(x,))
    before = sum(p.numel() for p in enc.parameters())
    after = sum(p.numel() for p in out.parameters())
    assert 0.4 * before <= after <= 0.5 * before
    assert any(isinstance(m, cc.BTTLinear) for m in out.modules())
    out(x).square().mean().backward()


def test_layer_config_fixes_a_rank_and_init_dense_projects():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
    out = cc.optimize(model, cc.CompressionConfig(
        layer_config={"0": {"format": "btt", "ranks": 2}}, include=["0"], init="dense"))
    layer = out[0]
    assert isinstance(layer, cc.BTTLinear) and layer.ranks == [1, 2, 1]
    assert layer.in_modes == btt_modes(64, 128)[0]
    best = cc.BTTLinear.from_dense(model[0], ranks=2)
    torch.testing.assert_close(layer.to_dense(), best.to_dense())


def test_rank_adaptive_trainer_cuts_btt_ranks():
    torch.manual_seed(0)
    model = nn.Sequential(cc.BTTLinear(64, 64, ranks=4), nn.ReLU(), cc.BTTLinear(64, 64, ranks=4))
    opt = torch.optim.AdamW(param_groups(model, lr=1e-3))
    trainer = cc.training.RankAdaptiveTrainer(model, opt, target_ratio=0.3)
    x = torch.randn(16, 64)
    for _ in range(3):
        loss = trainer.loss(model(x).square().mean())
        loss.backward()
        opt.step()
        opt.zero_grad()
        trainer.step()
    with torch.no_grad():
        model[0].gates[0][:2] = 0.0
    before = model(x)
    prune_model(model, opt)
    assert model[0].ranks == [1, 2, 1]
    torch.testing.assert_close(model(x), before)
    copy.deepcopy(model)(x).sum().backward()
