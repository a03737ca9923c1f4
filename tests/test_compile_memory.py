"""``memory="low"``: the compiled forward keeps a fraction of the activations for backward
(the rest is recomputed there) and the gradients stay exact."""

import pytest
import torch
import torch.nn.functional as F

import comera_compile.compile as cc
from comera_compile.cli.six_encoder import SixEncoderClassifier, SixEncoderConfig
from comera_compile.config import CompileOptions
from comera_compile.nn import TTEmbedding, TTLinear


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def encoder() -> SixEncoderClassifier:
    torch.manual_seed(0)
    config = SixEncoderConfig(
        vocab_size=500, hidden=64, ffn=256, heads=4, layers=1, max_position=32, dropout=0.0
    )
    model = SixEncoderClassifier(config)
    layer = model.layers[0]
    for name in ("query", "key", "value", "out"):
        setattr(layer.attention, name, TTLinear(64, 64, ranks=4))
    layer.ffn.fc_in, layer.ffn.fc_out = TTLinear(64, 256, ranks=4), TTLinear(256, 64, ranks=4)
    model.word_embeddings = TTEmbedding(500, 64, ranks=4)
    return model


def saved_mib_and_grads(memory: str):
    """MiB the forward saves for backward, and the gradients, for one compiled step."""
    model = encoder()
    torch._dynamo.reset()
    compiled = torch.compile(
        model, backend="comera", options={"inductor": False, "memory": memory}
    )
    ids = torch.randint(0, 500, (4, 32), generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([0, 1, 2, 0])
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(compiled(ids), labels)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(ids), labels).backward()
    eager = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return sum(saved) / 2**20, grads, eager


def test_low_memory_saves_under_half_the_activations_with_exact_gradients(monkeypatch):
    from comera_compile.compile.graph import recompute

    monkeypatch.setattr(recompute, "WIDE", 0)  # this small model's products are all narrow
    default, _, _ = saved_mib_and_grads("default")
    low, grads, eager = saved_mib_and_grads("low")
    assert low < 0.5 * default
    assert grads.keys() == eager.keys()
    for name, grad in eager.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_memory_option_is_checked_at_the_door():
    low = CompileOptions.from_backend_options({"memory": "low"})
    assert low.activation_budget == pytest.approx(0.999)
    assert CompileOptions.from_backend_options({"memory": 0.5}).activation_budget == 0.5
    with pytest.raises(ValueError, match="'memory' must be one of"):
        CompileOptions.from_backend_options({"memory": "tiny"})
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        CompileOptions.from_backend_options({"memory": 0.0})


def dropout_encoder() -> SixEncoderClassifier:
    """The one-layer encoder with dropout 0.1 in train mode: random masks in the graph."""
    model = encoder()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.1
    for layer in model.layers:
        layer.attention.dropout = 0.1
    return model.train()


def test_low_memory_keeps_the_forward_dropout_masks_for_backward():
    """A budget that recomputes everything it may must still not redraw dropout masks:
    under the same seed the gradients equal eager's (a fresh mask would change them)."""
    model = dropout_encoder()
    ids = torch.randint(0, 500, (4, 32), generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([0, 1, 2, 0])

    def grads(forward):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(123)
        F.cross_entropy(forward(ids), labels).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    eager = grads(model)
    compiled = torch.compile(model, backend="comera", options={"inductor": False, "memory": 0.05})
    got = grads(compiled)
    assert got.keys() == eager.keys()
    for name, grad in eager.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow
def test_low_memory_under_inductor_draws_each_dropout_mask_once():
    """Inductor orders its random draws its own way, so masks are compared by count: one
    step draws as many masks as the model has dropout calls, not more in backward."""
    from torch.profiler import profile

    model = dropout_encoder()
    ids = torch.randint(0, 500, (4, 32), generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([0, 1, 2, 0])
    compiled = cc.compile_model(model, memory=0.05)
    F.cross_entropy(compiled(ids), labels).backward()  # compile outside the profile
    with profile() as prof:
        F.cross_entropy(compiled(ids), labels).backward()
    keys = {e.key: e.count for e in prof.key_averages()}
    assert "aten::bernoulli_" not in keys  # masks are hashed from keys (compile.cpu.dropout)
    assert keys["aten::randint"] == 4  # embeddings, attention probabilities, two residuals


def saved_shapes(model, x, memory):
    """Shapes of what one compiled forward keeps for backward, and the input gradient."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="comera",
                             options={"inductor": False, "memory": memory})
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    x = x.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = compiled(x)
    out.square().sum().backward()
    return shapes, x.grad


def test_low_memory_recomputes_the_wide_outputs_of_thin_products(monkeypatch):
    """A TT layer's last matmul contracts a rank bond (4 here): its 32 x 256 output and the
    GELU of it are remade from the 32 x 4 factor in backward, not kept; by default they are
    kept. The gradients are the same. (The output is far below ``WIDE``, the size from
    which a real model's products are remade, so the test lowers it.)"""
    from comera_compile.compile.graph import recompute

    monkeypatch.setattr(recompute, "WIDE", 0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(TTLinear(64, 256, ranks=4), torch.nn.GELU(),
                                TTLinear(256, 64, ranks=4))
    x = torch.randn(32, 64)
    default, grad_default = saved_shapes(model, x, "default")
    low, grad_low = saved_shapes(model, x, "low")
    assert 4 <= recompute.THIN
    assert (32, 256) in default
    assert (32, 256) not in low
    wide = sum(32 * 256 for s in default if s == (32, 256))
    assert sum(torch.Size(s).numel() for s in low) <= sum(
        torch.Size(s).numel() for s in default) - wide
    torch.testing.assert_close(grad_low, grad_default, rtol=1e-5, atol=1e-6)


def test_low_memory_keeps_thin_products_too_small_to_repay_their_recomputation():
    """Below ``WIDE`` bytes a remade product saves little memory and still costs its kernels
    (at batch 1 x 128 the six-encoder's low-memory step was half again as slow for 8 MB):
    the 32 x 256 output is kept, as by default, and marking finds nothing to remake."""
    from torch.utils.checkpoint import CheckpointPolicy

    from comera_compile.compile.graph import recompute

    assert 32 * 256 * 4 < recompute.WIDE
    torch.manual_seed(0)
    model = torch.nn.Sequential(TTLinear(64, 256, ranks=4), torch.nn.GELU(),
                                TTLinear(256, 64, ranks=4))
    low, _ = saved_shapes(model, torch.randn(32, 64), "low")
    assert (32, 256) in low
    graph = torch.fx.Graph()
    t = graph.placeholder("t")
    b = graph.placeholder("b")
    t.meta["val"] = torch.empty(4096, 30, device="meta")
    b.meta["val"] = torch.empty(30, 3072, device="meta")
    product = graph.call_function(torch.ops.aten.mm.default, (t, b))
    product.meta["val"] = torch.empty(4096, 3072, device="meta")
    graph.output(product)
    assert recompute.recompute_thin_products(graph) == 1
    assert product.meta["recompute"] == CheckpointPolicy.MUST_RECOMPUTE
    product.meta["val"] = torch.empty(128, 3072, device="meta")  # batch 1 x 128: 1.5 MiB
    del product.meta["recompute"]
    assert recompute.recompute_thin_products(graph) == 0
