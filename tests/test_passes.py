"""Each pass alone: capture, shapes, candidates, budget parsing, specs, selection, rewrite,
report."""

import pytest
import torch
from models import MLP, dlrm_batch, small_dlrm
from torch import nn

import comera_compile.api as cc
from comera_compile.cli.six_encoder import SixEncoderClassifier, SixEncoderConfig
from comera_compile.nn import (
    SplitMultiheadAttention,
    TTEmbedding,
    TTLinear,
    TTMLinear,
)
from comera_compile.passes import Budget, capture, find_candidates, parse_budget, propagate_shapes
from comera_compile.passes.eligible import eligible_options
from comera_compile.passes.rewrite import build_layer, rewrite
from comera_compile.passes.select import select_layers
from comera_compile.passes.specs import auto_modes, make_spec

SMALL_SIX = SixEncoderConfig(vocab_size=1000, hidden=96, layers=1, heads=8, ffn=384)


def n_params(model):
    return sum(p.numel() for p in model.parameters())


# ----- budget ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, expected",
    [
        (0.05, Budget(fraction=0.05)),
        (1_500_000, Budget(params=1_500_000)),
        ("20MB", Budget(bytes=20_000_000)),
        ("512KiB", Budget(bytes=524_288)),
        ("1.5GB", Budget(bytes=1_500_000_000)),
        ("5%", Budget(fraction=0.05)),
        ("40x", Budget(ratio=40.0)),
    ],
)
def test_parse_budget_forms(text, expected):
    assert parse_budget(text) == expected


def test_budget_limits_take_the_tightest():
    limits = Budget(params=10_000, ratio=40, bytes="1KB").limits(200_000, 800_000, None)
    assert limits == {"params": 5_000, "bytes": 1_000}


# ----- capture ----------------------------------------------------------------------------------
def test_capture_paths():
    fx = capture(MLP())
    assert fx.path == "fx" and isinstance(fx.model, torch.fx.GraphModule)
    assert {"net.0", "net.2", "net.4"} <= fx.called
    six = SixEncoderClassifier(SMALL_SIX)
    walked = capture(six)
    assert walked.path == "modules" and walked.called is None
    assert "optional arguments (token_type_ids, attention_mask)" in walked.reason
    exported = capture(six, torch.randint(0, 1000, (2, 8)))
    assert exported.path == "export" and exported.model is six
    assert "layers.0.ffn.fc_in" in exported.called
    assert "token_type_embeddings" not in exported.called  # token_type_ids was not passed


# ----- shapes -----------------------------------------------------------------------------------
def test_shapes_rows_and_macs():
    model = MLP()
    info = propagate_shapes(model, torch.randn(2, 3, 256))
    assert info.layers["net.0"].input_shape == (2, 3, 256)
    assert info.layers["net.0"].rows == 6
    assert info.total_macs == 6 * (256 * 512 + 512 * 256 + 256 * 10)
    dlrm = small_dlrm()
    info = propagate_shapes(dlrm, dlrm_batch(dlrm, batch=8, bag=3))
    assert info.layers["tables.0"].rows == 24  # ids per call
    assert info.layers["bottom.0"].rows == 8


def test_shapes_kwargs_and_rng_untouched():
    six = SixEncoderClassifier(SMALL_SIX).train()
    ids = torch.randint(0, 1000, (2, 8))
    state = torch.get_rng_state()
    info = propagate_shapes(six, {"input_ids": ids, "token_type_ids": torch.zeros_like(ids)})
    assert torch.equal(torch.get_rng_state(), state)
    assert six.training and six.layers[0].training  # modes restored
    assert info.layers["layers.0.ffn.fc_out"].input_shape == (2, 8, 384)
    assert "token_type_embeddings" in info.called


# ----- candidates -------------------------------------------------------------------------------
class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(1000, 64)
        self.attn = nn.MultiheadAttention(64, 4, batch_first=True)
        self.proj = nn.Linear(64, 64)
        self.head = nn.Linear(64, 1000, bias=False)
        self.head.weight = self.embed.weight
        self.shared = self.proj  # the same module under two names

    def forward(self, ids):
        x = self.embed(ids)
        x = self.attn(x, x, x)[0]
        return self.head(self.shared(self.proj(x)))


def test_candidates_tied_direct_and_aliases():
    cands = {c.name: c for c in find_candidates(TiedLM())}
    assert cands["embed"].skip is None and cands["embed"].tied_heads == ["head"]
    assert "tied with the embedding 'embed'" in cands["head"].skip
    assert "reads the weight directly" in cands["attn.out_proj"].skip
    assert cands["proj"].skip is None and cands["proj"].aliases == ["shared"]


def test_shared_module_swapped_under_every_name():
    model = TiedLM()
    result = cc.optimize(model, cc.CompressionConfig(include=["proj"]),
                         example_inputs=torch.randint(0, 1000, (2, 5)), inplace=True, compile=False)
    assert result is model and cc.summary(model).capture_path == "fx"
    assert isinstance(model.proj, TTLinear) and model.shared is model.proj
    assert model.head.weight is model.embed.weight  # tie kept, both dense
    report = cc.summary(model)
    assert "tied with the embedding 'embed'" in report.skipped["head"]


# ----- specs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt, rank", [("tt", 7), ("ttm", 5), ("tt_embedding", 9)])
def test_spec_counts_match_built_layer(fmt, rank):
    module = nn.Embedding(3000, 48) if fmt == "tt_embedding" else nn.Linear(300, 200)
    (cand,) = find_candidates(nn.Sequential(module))
    spec = make_spec(cand, fmt, rank, *auto_modes(cand, fmt))
    layer = build_layer(cand, spec)
    assert n_params(layer) == spec.params
    assert layer.ranks == list(spec.ranks)
    assert type(layer) is {"tt": TTLinear, "ttm": TTMLinear, "tt_embedding": TTEmbedding}[fmt]


# ----- selection --------------------------------------------------------------------------------
def _select(model, budget, **kwargs):
    cands = find_candidates(model)
    before = {"params": n_params(model), "bytes": 4 * n_params(model), "macs": None}
    options, skipped = eligible_options(
        cands,
        None,
        None,
        kwargs.get("include"),
        kwargs.get("exclude"),
        None,
        kwargs.get("layer_config"),
        "tt",
        kwargs.get("max_rank"),
    )
    return select_layers(options, skipped, parse_budget(budget), before, kwargs.get("max_rank"))


def test_selection_spends_the_budget_and_keeps_heads_dense():
    model = MLP((256, 1024, 256, 64, 10))  # 262k, 262k, 16k, 640 params
    sel = _select(model, 0.3)
    assert 0.95 * 0.3 <= sel.after["params"] / sel.before["params"] <= 0.3
    assert "small output head" in sel.skipped["net.6"]
    saved = sum(cand.dense_params - spec.params for cand, spec in sel.chosen.values())
    assert sel.after["params"] == n_params(model) - saved


def test_include_exclude_filter_and_layer_config():
    model = MLP((256, 512, 256, 10))
    assert list(_select(model, None, exclude=["net.0"]).chosen) == ["net.2"]
    assert list(_select(model, None, exclude=["net.[02]"]).chosen) == []  # globs in a list
    assert list(_select(model, None, exclude=["*.2"]).chosen) == ["net.0"]
    assert list(_select(model, None, include=r"net\.(0|4)").chosen) == ["net.0", "net.4"]
    config = {"net.*": {"format": "ttm", "ranks": 4, "in_modes": [16, 16], "out_modes": [16, 32]}}
    sel = _select(model, None, layer_config={"net.0": config["net.*"]})
    spec = sel.chosen["net.0"][1]
    assert (spec.format, spec.in_modes, spec.out_modes, max(spec.ranks)) == (
        "ttm",
        (16, 16),
        (16, 32),
        4,
    )
    filtered = cc.optimize(model, cc.CompressionConfig(filter_fn=lambda m, name: name != "net.2"),
                           compile=False)
    assert not isinstance(filtered.get_submodule("net.2"), TTLinear)
    assert cc.summary(filtered).skipped["net.2"] == "filter_fn returned False"


def test_flops_budget_counts_multiply_adds():
    model = MLP((256, 1024, 256, 10))
    x = torch.randn(64, 256)
    dense_macs = 64 * (256 * 1024 + 1024 * 256 + 2560)
    result = cc.optimize(model, Budget(flops=dense_macs // 4), example_inputs=x, compile=False)
    assert cc.summary(result).records  # something was tensorized to cut the MACs
    assert result._comera_report.before["macs"] == dense_macs


# ----- rewrite ----------------------------------------------------------------------------------
def test_rewrite_keeps_graph_targets_and_dtype():
    gm = torch.fx.symbolic_trace(MLP().double())
    (cand,) = [c for c in find_candidates(gm) if c.name == "net.0"]
    spec = make_spec(cand, "tt", 4, *auto_modes(cand, "tt"))
    rewrite(gm, {"net.0": (cand, spec)})
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == [
        "net.0",
        "net.1",
        "net.2",
        "net.3",
        "net.4",
    ]
    assert isinstance(gm.get_submodule("net.0"), TTLinear)
    assert gm.get_submodule("net.0").cores[0].dtype == torch.float64
    assert gm(torch.randn(3, 256, dtype=torch.float64)).dtype == torch.float64


def test_hf_conv1d_dense_init_is_exact():
    from transformers.pytorch_utils import Conv1D

    conv = Conv1D(96, 64)  # nf=96 outputs, nx=64 inputs, weight (64, 96)
    nn.init.normal_(conv.weight)
    (cand,) = find_candidates(nn.Sequential(conv))
    assert (cand.kind, cand.in_features, cand.out_features) == ("conv1d", 64, 96)
    layer = build_layer(cand, make_spec(cand, "tt", 10_000, *auto_modes(cand, "tt")), "dense")
    x = torch.randn(5, 64)
    torch.testing.assert_close(layer(x), conv(x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("budget", [0.1, 0.7])  # attention tensorized / kept dense
def test_transformer_encoder_eval_fast_path_is_skipped(budget):
    """In eval under no_grad PyTorch would run TransformerEncoder(Layer) through fused
    kernels that read the dense weights; with tensorized layers inside, the model must take
    the ordinary forward through them: the same numbers as with the fast path switched off."""
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(64, 4, 1024, batch_first=True), 2)
    x = torch.randn(2, 5, 64)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[1, 3:] = True
    model = cc.optimize(enc, budget, format="tt", example_inputs=x, compile=False).eval()
    assert isinstance(model.layers[0].linear1, TTLinear)
    attention = type(model.layers[0].self_attn)
    assert attention is (SplitMultiheadAttention if budget < 0.5 else nn.MultiheadAttention)
    assert torch.backends.mha.get_fastpath_enabled()
    with torch.no_grad():
        out = model(x, src_key_padding_mask=mask)
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            reference = model(x, src_key_padding_mask=mask)
        finally:
            torch.backends.mha.set_fastpath_enabled(True)
    assert out.shape == (2, 5, 64) and not out.is_nested
    torch.testing.assert_close(out, reference)


# ----- report -----------------------------------------------------------------------------------
def test_summary_records_and_table():
    model = cc.optimize(MLP(), 0.2, format="tt", example_inputs=torch.randn(4, 256),
                        compile=False)
    report = cc.summary(model)
    first = report.records[0]
    assert first["name"] == "net.0" and first["original"] == "Linear(256, 512)"
    # the order is chosen by planned training cost at the example batch (see test_orders.py)
    assert (first["in_modes"], first["out_modes"]) == ([16, 16], [16, 32])
    assert first["order"] == 2 and "planned training cost at 4 rows" in first["order_reason"]
    assert first["params_before"] == 256 * 512 + 512
    assert first["params_after"] == n_params(model.get_submodule("net.0"))
    assert first["macs_per_row_before"] == 256 * 512
    assert report.params_after == n_params(model)
    table = str(report)
    assert table.splitlines()[0] == "capture: fx (torch.fx.symbolic_trace succeeded)"
    assert "net.0  Linear(256, 512)  tt" in table
    assert "left dense (1):" in table and "net.4: small output head" in table
    assert "  net.0: order 2: lowest planned training cost" in table


def test_summary_of_a_hand_built_model():
    model = nn.Sequential(TTLinear(768, 768, ranks=30), nn.ReLU())
    report = cc.summary(model)
    assert report.records[0]["params_before"] == 768 * 768 + 768
    assert report.params_after == n_params(model)
    assert report.capture_path is None
    with torch.no_grad():
        model[0].gates[1][:10] = 0
    assert cc.summary(model).records[0]["effective_ranks"] == [1, 12, 20, 30, 30, 12, 1]
