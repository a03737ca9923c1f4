"""Horizontal fusion: sibling Linear layers reading one input become one layer, exactly."""

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import comera_compile as cc
from comera_compile.cli.six_encoder import SixEncoderClassifier, SixEncoderConfig
from comera_compile.nn import tensorized_layers
from comera_compile.passes.fuse import fuse_linear_siblings, sibling_groups


class SwiGLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(16, 40, bias=False)
        self.up = nn.Linear(16, 40, bias=False)
        self.down = nn.Linear(40, 16, bias=False)
        self.skip = nn.Linear(16, 16)  # same input, but has a bias: not the same kind

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x)) + self.skip(x)


class Shared(nn.Module):
    """``a`` runs twice: fusing it would change the second call."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.a(x) + self.b(x) + self.a(x * 2)


def encoder() -> SixEncoderClassifier:
    torch.manual_seed(0)
    config = SixEncoderConfig(
        vocab_size=300, hidden=48, ffn=96, heads=4, layers=2, max_position=32, dropout=0.0
    )
    return SixEncoderClassifier(config).eval()


def test_query_key_value_fuse_exactly():
    model = encoder()
    gm = fx.symbolic_trace(model, concrete_args={"token_type_ids": None, "attention_mask": None})
    ids = torch.randint(0, 300, (3, 10))
    want = model(ids)
    fused = fuse_linear_siblings(gm)
    assert [g.members for g in fused] == [
        tuple(f"layers.{k}.attention.{n}" for n in ("query", "key", "value")) for k in range(2)
    ]
    assert fused[0].name == "layers.0.attention.query_key_value"
    assert fused[0].offsets == (0, 48, 96, 144)
    layer = gm.get_submodule(fused[0].name)
    assert (layer.in_features, layer.out_features) == (48, 144)
    names = {n for n, m in gm.named_modules() if isinstance(m, nn.Linear)}
    assert "layers.0.attention.query" not in names
    torch.testing.assert_close(gm(ids), want, rtol=1e-6, atol=1e-6)


def test_swiglu_gate_and_up_fuse_and_unlike_siblings_stay():
    torch.manual_seed(0)
    model = SwiGLU()
    gm = fx.symbolic_trace(model)
    x = torch.randn(5, 16)
    want = model(x)
    (group,) = fuse_linear_siblings(gm)
    assert group.members == ("gate", "up") and group.name == "gate_up"
    torch.testing.assert_close(gm(x), want, rtol=1e-6, atol=1e-6)
    assert not sibling_groups(fx.symbolic_trace(Shared()))


class IdsOnly(nn.Module):
    """The encoder called with ids alone: a forward fx traces whole."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = encoder()

    def forward(self, ids):
        return self.inner(ids)


def test_optimize_with_fuse_tensorizes_one_chain_for_qkv():
    model = IdsOnly()
    ids = torch.randint(0, 300, (2, 8))
    settings = {"example_inputs": (ids,), "compile": False}
    plain = cc.optimize(model, cc.CompressionConfig(include=r".*layers\..*"), **settings)
    fused = cc.optimize(model, cc.CompressionConfig(include=r".*layers\..*", fuse=True),
                        **settings)
    names = set(tensorized_layers(fused))
    assert "inner.layers.1.attention.query_key_value" in names
    assert len(tensorized_layers(plain)) - len(names) == 2 * 2  # three became one, twice
    assert fused(ids).shape == (2, 3)
    assert isinstance(model.inner.layers[0].attention.query, nn.Linear)  # caller's model kept


def test_fuse_needs_an_fx_graph():
    class Untraceable(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            if x.sum() > 0:  # data-dependent: fx cannot trace it
                return self.a(x)
            return self.b(x)

    with pytest.raises(ValueError, match="fuse=False"):
        cc.optimize(Untraceable(), cc.CompressionConfig(fuse=True),
                    example_inputs=(torch.randn(2, 8),), compile=False)
