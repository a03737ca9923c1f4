"""Attention through the TT bonds: the same values and gradients as the standard form."""

import copy
import logging

import pytest
import torch
import torch.nn.functional as F

from comera_compile.cli.six_encoder import SixEncoderClassifier, SixEncoderConfig
from comera_compile.compile import compile_model
from comera_compile.compile.graph.absorbed_attention import absorbed_attention, bond_factors
from comera_compile.nn import TTLinear


def tt(n_in: int, n_out: int, rank: int, in_modes, out_modes) -> TTLinear:
    layer = TTLinear(n_in, n_out, ranks=rank, in_modes=in_modes, out_modes=out_modes)
    with torch.no_grad():
        layer.bias.normal_()
    return layer


def test_bond_factors_multiply_to_the_dense_weight():
    torch.manual_seed(0)
    layer = tt(48, 40, 6, [4, 3, 4], [2, 5, 4])
    left, right = bond_factors(layer.network_cores(), 3)
    assert left.shape == (48, 6) and right.shape == (6, 40)
    torch.testing.assert_close(left @ right, layer.to_dense().T, rtol=1e-5, atol=1e-6)


def _standard(x, layers, heads, **sdpa):
    q, k, v, o = layers
    b, t, c = x.shape
    q, k, v = (p(x).view(b, t, heads, -1).transpose(1, 2) for p in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, **sdpa)
    return o(y.transpose(1, 2).reshape(b, t, -1))


def _absorbed(x, layers, heads, **sdpa):
    q, k, v, o = layers
    b, t, c = x.shape
    rows = x.reshape(b * t, 4, 4, 4)
    view = (b, t, heads, c // heads)
    y = absorbed_attention(
        rows, rows, rows, *(p.network_cores() for p in layers), q.bias, k.bias, v.bias,
        (3, 3, 3, 3), view, view, view, (b * t, 4, 4, 4), **sdpa)
    return y.reshape(b, t, c) + o.bias


@pytest.mark.parametrize("sdpa", [
    {}, {"is_causal": True}, {"scale": 0.3},
    {"attn_mask": torch.tensor([True] * 5 + [False] * 2)[None, None, None, :].expand(3, 1, 1, 7)},
    {"attn_mask": torch.randn(3, 1, 7, 7)},
], ids=["plain", "causal", "scale", "bool-mask", "float-mask"])
def test_absorbed_attention_equals_sdpa_with_tt_projections(sdpa):
    torch.manual_seed(0)
    layers = [tt(64, 64, 5, [4, 4, 4], [4, 4, 4]) for _ in range(4)]
    x = torch.randn(3, 7, 64, requires_grad=True)
    want = _standard(x, layers, heads=2, **sdpa)
    got = _absorbed(x, layers, heads=2, **sdpa)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    weights = [x, *(p for layer in layers for p in layer.parameters())]
    dy = torch.randn_like(want)
    g_want = torch.autograd.grad(want, weights, dy)
    g_got = torch.autograd.grad(got, weights, dy)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
    # the key bias only shifts each query's scores: its gradient is zero in both forms
    key_bias = next(i for i, w in enumerate(weights) if w is layers[1].bias)
    assert g_got[key_bias].abs().max() == 0


def _encoder(rank: int, dropout: float = 0.0) -> SixEncoderClassifier:
    """One BERT-like layer, width 128 in 2 heads of 64, Q/K/V/O as TT layers of ``rank``."""
    torch.manual_seed(0)
    config = SixEncoderConfig(
        vocab_size=500, hidden=128, heads=2, ffn=64, layers=1, max_position=16, dropout=dropout
    )
    model = SixEncoderClassifier(config)
    for name in ("query", "key", "value", "out"):
        layer = tt(128, 128, rank, [8, 4, 4], [4, 4, 8])
        setattr(model.layers[0].attention, name, layer)
    return model.train()


def _loss_and_grads(model, ids, mask, labels):
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(ids, attention_mask=mask), labels)
    loss.backward()
    return loss, {n.replace("_orig_mod.", ""): p.grad for n, p in model.named_parameters()}


@pytest.mark.slow
def test_compiled_encoder_absorbs_its_attention_with_eager_gradients(caplog):
    model = _encoder(rank=8)
    ids = torch.randint(0, 500, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0
    labels = torch.tensor([0, 2])
    want, g_want = _loss_and_grads(model, ids, mask, labels)
    with caplog.at_level(logging.INFO, logger="comera_compile"):
        compiled = compile_model(copy.deepcopy(model))
        got, g_got = _loss_and_grads(compiled, ids, mask, labels)
    assert "1 attention(s) computed through their rank bonds" in caplog.text
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for name, g in g_want.items():
        if g is None:
            continue
        if name.endswith("attention.key.bias"):  # rounding noise in eager, exact zero here
            assert g_got[name].abs().max() == 0 and g.abs().max() < 1e-6
            continue
        torch.testing.assert_close(g_got[name], g, rtol=1e-3, atol=1e-6, msg=name)


@pytest.mark.slow
def test_bonds_as_wide_as_the_heads_or_the_option_off_keep_the_standard_form(caplog):
    ids = torch.randint(0, 500, (2, 12))
    with caplog.at_level(logging.INFO, logger="comera_compile"):
        compile_model(_encoder(rank=64))(ids)  # bond 64 = head width 64: no gain
        compile_model(_encoder(rank=8), absorb_attention=False)(ids)
    assert "through their rank bonds" not in caplog.text


@pytest.mark.slow
def test_absorbed_attention_trains_with_dropout():
    model = compile_model(_encoder(rank=8, dropout=0.1))
    ids = torch.randint(0, 500, (4, 12), generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([0, 1, 2, 1])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = F.cross_entropy(model(ids), labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0]


def test_cross_attention_with_another_key_length():
    torch.manual_seed(1)
    q, k, v, o = layers = [tt(64, 64, 5, [4, 4, 4], [4, 4, 4]) for _ in range(4)]
    x, memory = torch.randn(3, 7, 64), torch.randn(3, 5, 64)
    heads = (q(x).view(3, 7, 2, 32).transpose(1, 2),
             *(p(memory).view(3, 5, 2, 32).transpose(1, 2) for p in (k, v)))
    want = o(F.scaled_dot_product_attention(*heads).transpose(1, 2).reshape(3, 7, 64))
    got = absorbed_attention(
        x.reshape(21, 4, 4, 4), memory.reshape(15, 4, 4, 4), memory.reshape(15, 4, 4, 4),
        *(p.network_cores() for p in layers), q.bias, k.bias, v.bias, (3, 3, 3, 3),
        (3, 7, 2, 32), (-1, 5, 2, 32), (3, 5, 2, 32), (21, 4, 4, 4))
    torch.testing.assert_close(got.reshape(3, 7, 64) + o.bias, want, rtol=1e-4, atol=1e-5)



@pytest.mark.parametrize("r_q, r_k, r_v, r_o", [(4, 5, 6, 9), (7, 9, 3, 5)])
def test_attention_on_bonds_equals_the_standard_form_for_unequal_bonds(r_q, r_k, r_v, r_o):
    """Bonds of different widths (the narrower heads are zero-padded for torch's kernel)."""
    from comera_compile.compile.graph.absorbed_attention import attention_on_bonds

    torch.manual_seed(0)
    b, t, h, d = 2, 6, 2, 8
    c = h * d
    tq, tk, tv = (torch.randn(b, t, r, requires_grad=True) for r in (r_q, r_k, r_v))
    rq, rk, rv = (torch.randn(r, c, requires_grad=True) for r in (r_q, r_k, r_v))
    lo = torch.randn(c, r_o, requires_grad=True)
    bq, bk, bv = (torch.randn(c, requires_grad=True) for _ in range(3))
    heads = lambda y: y.view(b, t, h, d).transpose(1, 2)  # noqa: E731
    y = F.scaled_dot_product_attention(heads(tq @ rq + bq), heads(tk @ rk + bk),
                                       heads(tv @ rv + bv), is_causal=True)
    want = y.transpose(1, 2).reshape(b, t, c) @ lo
    view = (b, t, h, d)
    got = attention_on_bonds(tq, tk, tv, rq, rk, rv, lo, bq, bk, bv, view, view, view,
                             is_causal=True, out_dims=3)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    weights = [tq, tk, tv, rq, rk, rv, lo, bq, bv]
    dy = torch.randn_like(want)
    for a, e in zip(torch.autograd.grad(got, weights, dy), torch.autograd.grad(want, weights, dy)):
        torch.testing.assert_close(a, e, rtol=1e-3, atol=1e-4)
