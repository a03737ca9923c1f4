"""nn.MultiheadAttention is tensorized through SplitMultiheadAttention: equal to torch's
module in every configuration (and at full rank after init="dense"), and torch's own
Transformer encoder / decoder reach a 5% budget."""

import pytest
import torch
from torch import nn

import comera_compile as cc
from comera_compile.nn import SplitMultiheadAttention, TensorizedLayer

E, HEADS = 16, 4


def _inputs(batch_first, kdim=E, vdim=E, batched=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    lead = ((2, 5) if batch_first else (5, 2)) if batched else (5,)
    src = ((2, 7) if batch_first else (7, 2)) if batched else (7,)
    return (torch.randn(*lead, E, generator=g), torch.randn(*src, kdim, generator=g),
            torch.randn(*src, vdim, generator=g))


CONFIGS = {
    "packed": dict(),
    "packed batch_first": dict(batch_first=True),
    "kdim vdim": dict(kdim=12, vdim=8),
    "kdim vdim batch_first": dict(kdim=12, vdim=8, batch_first=True),
    "no bias": dict(bias=False, batch_first=True),
    "bias_kv zero_attn": dict(add_bias_kv=True, add_zero_attn=True),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("need_weights", [True, False])
def test_split_attention_equals_torch(name, need_weights):
    torch.manual_seed(0)
    cfg = CONFIGS[name]
    mha = nn.MultiheadAttention(E, HEADS, **cfg).eval()
    split = SplitMultiheadAttention(mha).eval()
    bf = cfg.get("batch_first", False)
    q, k, v = _inputs(bf, cfg.get("kdim", E), cfg.get("vdim", E))
    padding = torch.zeros(2, 7, dtype=torch.bool)
    padding[1, -2:] = True
    causal = nn.Transformer.generate_square_subsequent_mask(7)[:5]
    for masks in ({}, {"key_padding_mask": padding}, {"attn_mask": causal},
                  {"attn_mask": causal < 0, "key_padding_mask": padding},
                  {"attn_mask": torch.randn(2 * HEADS, 5, 7)}):
        for average in (True, False):
            kwargs = dict(need_weights=need_weights, average_attn_weights=average, **masks)
            with torch.no_grad():
                want, got = mha(q, k, v, **kwargs), split(q, k, v, **kwargs)
            torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
            if need_weights:
                torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
            else:
                assert got[1] is None and want[1] is None


def test_split_attention_unbatched_and_dropout_follows_mode():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, HEADS, dropout=0.5)
    split = SplitMultiheadAttention(mha)
    q, k, v = _inputs(False, batched=False)
    mha.eval()
    split.eval()
    with torch.no_grad():
        torch.testing.assert_close(split(q, k, v)[0], mha(q, k, v)[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(split(q, k, v)[0], split(q, k, v)[0])
    split.train()
    with torch.no_grad():
        assert not torch.equal(split(q, k, v)[0], split(q, k, v)[0])


class Attend(nn.Module):
    def __init__(self, **cfg) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(64, 4, **cfg)

    def forward(self, q, k, v):
        return self.attn(q, k, v)[0]


@pytest.mark.parametrize("cfg", [dict(batch_first=True), dict(kdim=96, vdim=80)])
def test_optimized_attention_at_full_rank_equals_original(cfg):
    torch.manual_seed(0)
    model = Attend(**cfg).eval()
    q = torch.randn(3, 6, 64) if cfg.get("batch_first") else torch.randn(6, 3, 64)
    k = torch.randn(q.shape[0], q.shape[1], cfg.get("kdim", 64))
    v = torch.randn(q.shape[0], q.shape[1], cfg.get("vdim", 64))
    result = cc.optimize(model, cc.CompressionConfig(max_rank=10_000), init="dense",
                         compile=False).eval()
    projections = [m for m in result.attn.modules() if isinstance(m, TensorizedLayer)]
    assert isinstance(result.attn, SplitMultiheadAttention) and len(projections) == 4
    with torch.no_grad():
        torch.testing.assert_close(result(q, k, v), model(q, k, v), rtol=1e-5, atol=1e-5)


def _n(model):
    return sum(p.numel() for p in model.parameters())


@pytest.mark.slow  # plans every projection of two models (about 10 s on 2 cores)
def test_transformer_encoder_and_decoder_reach_five_percent():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(128, 4, 512, dropout=0.1, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(128, 4, 512, dropout=0.1), 2)
    x, memory = torch.randn(2, 9, 128), torch.randn(7, 2, 128)
    for model, inputs in ((encoder, (x,)), (decoder, (x.transpose(0, 1), memory))):
        result = cc.optimize(model, 0.05, compile=False)
        assert _n(result) <= 0.05 * _n(model)
        assert type(result) is type(model)
        result.eval()
        with torch.no_grad():
            out = result(*inputs)
            assert torch.equal(out, result(*inputs)) and torch.isfinite(out).all()
        attn = result.layers[0].self_attn
        assert isinstance(attn, SplitMultiheadAttention)
        assert isinstance(attn.q_proj, TensorizedLayer)


def test_attention_left_dense_is_restored():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 1024, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
    result = cc.optimize(encoder, 0.7, compile=False)
    assert isinstance(result.layers[0].linear1, TensorizedLayer)
    assert type(result.layers[0].self_attn) is nn.MultiheadAttention
    assert "nn.MultiheadAttention kept as is" in cc.summary(result).skipped["layers.0.self_attn"]
