"""MonarchLinear and format="monarch": the math against block-diagonal matrices and explicit
permutations, gradients, counts, init and learning rates, no rank (the trainer passes it
by), checkpoints, the backend and optimize's budget."""

from __future__ import annotations

import math

import hf_models
import pytest
import torch
from torch import nn

import comera_compile as cc
from comera_compile.formats import monarch_blocks_for, monarch_modes, monarch_params
from comera_compile.passes.specs import LayerSpec
from comera_compile.training import param_groups, prune_model


def permutation(size: int, target) -> torch.Tensor:
    """The matrix ``P`` with ``(x @ P)[target(i)] = x[i]``."""
    p = torch.zeros(size, size, dtype=torch.float64)
    for i in range(size):
        p[i, target(i)] = 1.0
    return p


def dense_of(layer: cc.MonarchLinear) -> torch.Tensor:
    """``x @ M`` of the padded layer as ``BD(L) P BD(R) Q`` with explicit matrices: the
    stride permutation reads the flat ``(b, q)`` middle as ``(q, b)`` transposed, ``Q``
    writes block ``l``'s output ``u`` to ``u b + l``."""
    left, right = (c.detach().double() for c in layer.cores)
    b, p, q = left.shape
    s = right.shape[2]
    bd_left = torch.block_diag(*left)  # (b p, b q)
    bd_right = torch.block_diag(*right)  # (b q, b s)
    # h index k q + j = t b + l goes to block l, row t: position l q + t
    mid = permutation(b * q, lambda f: (f % b) * q + f // b)
    out = permutation(b * s, lambda f: (f % s) * b + f // s)  # l s + u -> u b + l
    w = bd_left @ mid @ bd_right @ out
    return w[: layer.in_features, : layer.out_features]


@pytest.mark.parametrize("sizes,blocks", [((24, 40), 4), ((30, 50), 4), ((64, 64), 8),
                                          ((50, 20), 3)])
def test_forward_equals_block_diagonals_and_permutations(sizes, blocks):
    torch.manual_seed(0)
    layer = cc.MonarchLinear(*sizes, blocks=blocks).double()
    x = torch.randn(2, 3, sizes[0], dtype=torch.float64)
    torch.testing.assert_close(layer(x), x @ dense_of(layer) + layer.bias)
    torch.testing.assert_close(layer.to_dense(), dense_of(layer).T)


def test_gradients_match_the_dense_equivalent():
    torch.manual_seed(1)
    layer = cc.MonarchLinear(24, 40, blocks=4).double()
    x = torch.randn(7, 24, dtype=torch.float64, requires_grad=True)
    target = torch.randn(7, 40, dtype=torch.float64)
    (layer(x) - target).square().sum().backward()
    got = [p.grad.clone() for p in (*layer.cores, layer.bias)] + [x.grad.clone()]
    # the same loss through the explicit dense matrix, differentiated by autograd
    cores = [c.detach().clone().requires_grad_() for c in layer.cores]
    b, p, q = cores[0].shape
    s = cores[1].shape[2]
    mid = permutation(b * q, lambda f: (f % b) * q + f // b)
    out = permutation(b * s, lambda f: (f % s) * b + f // s)
    w = (torch.block_diag(*cores[0]) @ mid @ torch.block_diag(*cores[1]) @ out)[:24, :40]
    x2 = x.detach().clone().requires_grad_()
    bias = layer.bias.detach().clone().requires_grad_()
    (x2 @ w + bias - target).square().sum().backward()
    for g, want in zip(got, [cores[0].grad, cores[1].grad, bias.grad, x2.grad]):
        torch.testing.assert_close(g, want)


def test_parameter_count_is_the_formula_and_there_is_no_rank():
    layer = cc.MonarchLinear(384, 1024, blocks=4)
    b, p, s = 4, 96, 256
    assert layer.in_modes == (b, p) and layer.out_modes == (b, s)
    q = min(p, s)
    cores = b * p * q + b * q * s
    assert layer.num_core_parameters() == cores == monarch_params((b, p), (b, s))
    assert sum(p.numel() for p in layer.parameters()) == cores + 1024  # no gate
    assert len(layer.gates) == 0 and layer.ranks == [1, 1] == layer.effective_ranks()
    spec = LayerSpec("monarch", 384, 1024, (b, p), (b, s), (1, 1), True)
    assert spec.params == cores + 1024 and spec.macs_per_row() == cores
    assert not layer.prune_ranks()
    assert layer.compression_ratio() == pytest.approx(384 * 1024 / cores)


def test_block_count_for_a_share_holds_the_most_parameters_within_it():
    target = 0.25 * 384 * 1024
    blocks = monarch_blocks_for(384, 1024, target)
    count = monarch_params(*monarch_modes(384, 1024, blocks))
    assert count <= target
    fitting = [monarch_params(*monarch_modes(384, 1024, b)) for b in range(1, 385)]
    assert count >= 0.9 * max(c for c in fitting if c <= target)
    assert monarch_blocks_for(64, 64, 10) is None


def test_init_stds_follow_each_factor_fan_in_and_lrs_its_share():
    torch.manual_seed(0)
    layer = cc.MonarchLinear(256, 1024, blocks=4, bias=False)
    p, q, s = 64, 64, 256
    want = [math.sqrt(1 / p) * min(1, math.sqrt(q / p)),
            math.sqrt(1 / q) * min(1, math.sqrt(s / q))]
    for core, std in zip(layer.cores, want):
        assert float(core.detach().std()) == pytest.approx(std, rel=0.05)
    groups = param_groups(layer, lr=1e-3)
    rates = {id(p): g["lr"] for g in groups for p in g["params"]}
    assert rates[id(layer.cores[0])] == pytest.approx(1e-3 * 256 / p / 2, rel=1e-3)
    assert rates[id(layer.cores[1])] == pytest.approx(1e-3 * 256 / q / 2, rel=1e-3)
    assert not any(g["name"] == "gates" for g in groups)


def test_from_dense_recovers_a_monarch_matrix_exactly():
    torch.manual_seed(0)
    source = cc.MonarchLinear(30, 50, blocks=4).double()
    dense = nn.Linear(30, 50).double()
    with torch.no_grad():
        dense.weight.copy_(source.to_dense())
    fitted = cc.MonarchLinear.from_dense(dense, blocks=4)
    torch.testing.assert_close(fitted.to_dense(), dense.weight.detach())
    with pytest.raises(ValueError, match="block count"):
        cc.MonarchLinear.from_dense(dense, tolerance=0.1)


def test_backend_traces_without_a_graph_break_and_equals_eager():
    torch.manual_seed(0)
    layer = cc.MonarchLinear(30, 50, blocks=4)
    x = torch.randn(4, 30)
    assert torch._dynamo.explain(layer)(x).graph_break_count == 0
    torch.testing.assert_close(torch.compile(layer, backend="comera")(x), layer(x))
    torch._dynamo.reset()


def test_optimize_meets_the_budget_on_llama_and_saves_and_loads(tmp_path):
    build, inputs, loss_fn = hf_models.llama()
    torch.manual_seed(0)
    model = build()
    out = cc.optimize(model, budget=0.5, format="monarch", example_inputs=inputs)
    before = sum(p.numel() for p in model.parameters())
    after = sum(p.numel() for p in out.parameters())
    assert 0.4 * before <= after <= 0.5 * before
    assert any(isinstance(m, cc.MonarchLinear) for m in out.modules())
    loss_fn(out(**inputs).logits).backward()
    out.eval()
    cc.save(out, tmp_path)
    loaded = cc.load(tmp_path)
    loaded.eval()
    torch.testing.assert_close(loaded(**inputs).logits, out(**inputs).logits, rtol=0, atol=0)


def test_optimize_meets_the_budget_on_a_transformer_encoder_and_layer_config_blocks():
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0, batch_first=True), 2)
    x = torch.randn(2, 10, 64)
    out = cc.optimize(enc, budget=0.5, format="monarch", example_inputs=(x,))
    before = sum(p.numel() for p in enc.parameters())
    assert sum(p.numel() for p in out.parameters()) <= 0.5 * before
    out(x).square().mean().backward()
    fixed = cc.optimize(enc, cc.CompressionConfig(
        layer_config={"layers.*.linear1": {"format": "monarch", "blocks": 8}},
        include=["linear1"]))
    assert fixed.layers[0].linear1.blocks == 8
    with pytest.raises(ValueError, match="blocks= sets a Monarch"):
        cc.optimize(enc, cc.CompressionConfig(
            layer_config={"layers.*.linear1": {"format": "btt", "blocks": 8}},
            include=["linear1"]))


def test_rank_adaptive_trainer_passes_monarch_by():
    torch.manual_seed(0)
    model = nn.Sequential(cc.MonarchLinear(64, 64, blocks=4), nn.ReLU(),
                          cc.BTTLinear(64, 64, ranks=4))
    opt = torch.optim.AdamW(param_groups(model, lr=1e-3))
    trainer = cc.training.RankAdaptiveTrainer(model, opt, target_ratio=0.3)
    x = torch.randn(16, 64)
    start = model[0].cores[0].detach().clone()
    for _ in range(3):
        loss = trainer.loss(model(x).square().mean())
        loss.backward()
        opt.step()
        opt.zero_grad()
        trainer.step()
    assert not torch.equal(model[0].cores[0], start)  # it trains
    assert list(trainer.bank.names) == ["2"]  # only the layer with a rank is adapted
    with torch.no_grad():
        model[2].gates[0][:2] = 0.0
    assert set(prune_model(model, opt)) == {"2"}
    assert model[0].num_core_parameters() == 2 * 4 * 16 * 16
