"""Attention through the rank bonds of the default format (CoLA) on models we did not
write: compiled values and gradients equal eager, and the log says the attention was
absorbed."""

import copy
import logging

import pytest
import torch
import torch.nn.functional as F

from comera_compile.compile import compile_model
from comera_compile.nn import CoLALinear


class _ColaAttention(torch.nn.Module):
    """Pre-norm self-attention whose projections are CoLA layers (silu on the bond): Q, K
    and V as layers of their own, or one fused layer split as models write it."""

    def __init__(self, width: int, heads: int, rank: int, qkv: str = "separate") -> None:
        super().__init__()
        self.heads, self.qkv = heads, qkv
        self.norm = torch.nn.LayerNorm(width)
        if qkv == "separate":
            self.q, self.k, self.v = (CoLALinear(width, width, ranks=rank) for _ in range(3))
        else:
            self.fused = CoLALinear(width, 3 * width, ranks=rank)
        self.o = CoLALinear(width, width, ranks=rank)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("bias"):
                    p.normal_()

    def forward(self, x):
        b, t, c = x.shape
        h = self.norm(x)
        if self.qkv == "separate":
            q, k, v = (p(h).view(b, t, self.heads, -1).transpose(1, 2)
                       for p in (self.q, self.k, self.v))
        elif self.qkv == "unbind":  # timm's vision transformers
            packed = self.fused(h).reshape(b, t, 3, self.heads, -1)
            q, k, v = packed.permute(2, 0, 3, 1, 4).unbind(0)
        else:  # nanoGPT's split, or chunk
            parts = self.fused(h).split(c, dim=2) if self.qkv == "split" else (
                self.fused(h).chunk(3, dim=-1))
            q, k, v = (y.view(b, t, self.heads, -1).transpose(1, 2) for y in parts)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(b, t, c))


@pytest.mark.slow
@pytest.mark.parametrize("qkv", ["separate", "split", "chunk", "unbind"])
def test_cola_attention_compiles_through_its_bonds_with_eager_values_and_gradients(qkv, caplog):
    torch.manual_seed(0)
    model = _ColaAttention(width=64, heads=2, rank=6, qkv=qkv)
    x = torch.randn(3, 10, 64)
    proj = torch.randn(64)  # a random projection: a LayerNorm'd .sum() has zero gradient
    want = model(x)
    g_want = torch.autograd.grad((want @ proj).square().mean(), list(model.parameters()))
    with caplog.at_level(logging.INFO, logger="comera_compile"):
        compiled = compile_model(copy.deepcopy(model))
        got = compiled(x)
    assert "1 attention(s) computed through their rank bonds" in caplog.text
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    g_got = torch.autograd.grad((got @ proj).square().mean(), list(compiled.parameters()))
    names = [n for n, _ in model.named_parameters()]
    for name, a, b in zip(names, g_got, g_want):
        if name == "k.bias":  # the softmax cancels it: an exact zero through the bonds
            assert a.abs().max() == 0 and b.abs().max() < 1e-5
            continue
        if name == "fused.bias":  # its key third is cancelled the same way
            assert a[64:128].abs().max() == 0 and b[64:128].abs().max() < 1e-5
            a, b = torch.cat([a[:64], a[128:]]), torch.cat([b[:64], b[128:]])
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("name, budget", [("gpt2", 0.1), ("bert", 0.1)])
def test_hugging_face_attention_compiles_through_its_bonds(name, budget, caplog):
    """GPT-2's fused ``c_attn`` (Q, K, V split from one layer, behind an empty key / value
    cache) and BERT's separate projections (as ViT's): absorbed, with eager's values and
    gradients. One layer: each layer's attention is matched alone."""
    pytest.importorskip("transformers")
    import comera_compile as cc
    from tests import hf_models

    build, inputs, _ = getattr(hf_models, name)(layers=1)
    torch.manual_seed(0)
    model = cc.optimize(build().eval(), budget=budget, example_inputs=inputs, compile=False,
                        format="cola")
    want = model(**inputs).logits
    proj = torch.randn(want.shape[-1])
    params = [p for p in model.parameters() if p.requires_grad]
    g_want = torch.autograd.grad((want @ proj).square().mean(), params, allow_unused=True)
    with caplog.at_level(logging.INFO, logger="comera_compile"):
        compiled = compile_model(model)
        got = compiled(**inputs).logits
    assert "1 attention(s) computed through their rank bonds" in caplog.text
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    g_got = torch.autograd.grad((got @ proj).square().mean(), params, allow_unused=True)
    scale = max(float(g.abs().max()) for g in g_want if g is not None)
    for a, b in zip(g_got, g_want):
        if a is not None and b is not None and b.abs().max() > 1e-4 * scale:
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4 * scale)


@pytest.mark.slow
@pytest.mark.parametrize("batch_first", [True, False])
def test_torch_transformer_encoder_attention_compiles_through_its_bonds(batch_first, caplog):
    import comera_compile as cc

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 2, 128, dropout=0.0, batch_first=batch_first)
    dense = torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
    x = torch.randn((3, 10, 64) if batch_first else (10, 3, 64))
    model = cc.optimize(dense, budget=0.1, example_inputs=(x,), compile=False, format="cola")
    want = model(x)
    proj = torch.randn(64)
    params = list(model.parameters())
    g_want = torch.autograd.grad((want @ proj).square().mean(), params)
    with caplog.at_level(logging.INFO, logger="comera_compile"):
        got = compile_model(model)(x)
    assert "1 attention(s) computed through their rank bonds" in caplog.text
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    g_got = torch.autograd.grad((got @ proj).square().mean(), params)
    names = [n for n, _ in model.named_parameters()]
    for name, a, b in zip(names, g_got, g_want):
        if name.endswith("k_proj.bias"):  # the softmax cancels it: exact zero through the bonds
            assert a.abs().max() == 0 and b.abs().max() < 1e-5
            continue
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5, msg=name)
