"""Activation-aware decomposition: truncating the whitened weight lowers the output error."""

import copy
import warnings

import pytest
import torch
from torch import nn

import comera_compile.api as cc
from comera_compile.formats.whiten import gram_factor, mode_gram_factors
from comera_compile.nn import LowRankLinear, TTLinear, TTMLinear


def _anisotropic_inputs(rows: int, features: int, seed: int = 0) -> torch.Tensor:
    """Inputs whose energy sits in a few directions (one fixed basis), as a transformer's
    activations do; ``seed`` draws other rows of the same distribution."""
    scales = torch.logspace(0, -2, features)
    basis = torch.linalg.qr(torch.randn(features, features,
                                        generator=torch.Generator().manual_seed(0)))[0]
    gen = torch.Generator().manual_seed(seed + 1)
    return (torch.randn(rows, features, generator=gen) * scales) @ basis


def _output_error(layer: nn.Module, dense: nn.Linear, x: torch.Tensor) -> float:
    with torch.no_grad():
        want = x @ dense.weight.T
        got = layer(x) - layer.bias if layer.bias is not None else layer(x)
        return float((got - want).square().sum() / want.square().sum())


@pytest.mark.parametrize("cls, modes", [
    (LowRankLinear, {}),
    (TTLinear, {"in_modes": (8, 8), "out_modes": (6, 8)}),
    (TTMLinear, {"in_modes": (8, 8), "out_modes": (6, 8)}),
])
def test_whitened_truncation_has_lower_output_error(cls, modes):
    torch.manual_seed(0)
    dense = nn.Linear(64, 48)
    calibration = _anisotropic_inputs(2000, 64)
    held = _anisotropic_inputs(500, 64, seed=1)
    gram = calibration.T @ calibration / len(calibration)
    plain = cls.from_dense(dense, ranks=6, **modes)
    whitened = cls.from_dense(dense, ranks=6, gram=gram, **modes)
    assert whitened.ranks == plain.ranks
    # exact whitening (low rank, TT's middle bond) gains much; TTM's Kronecker-factored less
    gain = 0.9 if cls is not TTMLinear else 1.0
    assert _output_error(whitened, dense, calibration) < gain * _output_error(
        plain, dense, calibration)
    assert _output_error(whitened, dense, held) < _output_error(plain, dense, held)


def test_whitened_decomposition_is_exact_at_full_rank():
    torch.manual_seed(0)
    dense = nn.Linear(12, 10)
    x = _anisotropic_inputs(100, 12)
    gram = x.T @ x
    for cls, modes in ((TTLinear, {"in_modes": (3, 4), "out_modes": (2, 5)}),
                       (TTMLinear, {"in_modes": (3, 4), "out_modes": (2, 5)}),
                       (LowRankLinear, {})):
        layer = cls.from_dense(dense, ranks=None, gram=gram, **modes)
        torch.testing.assert_close(layer.to_dense(), dense.weight, atol=1e-4, rtol=1e-4)


def test_gram_factors_survive_singular_grams():
    gram = torch.zeros(6, 6)
    gram[0, 0] = 4.0  # one direction seen, the rest never
    factor = gram_factor(gram)
    assert torch.isfinite(factor).all() and float(factor.diagonal().min()) > 0
    for f in mode_gram_factors(gram, (2, 3)):
        assert torch.isfinite(torch.linalg.inv(f)).all()


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 128)
        self.down = nn.Linear(128, 64)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def test_optimize_with_example_inputs_truncates_what_the_outputs_feel():
    torch.manual_seed(0)
    teacher = _Encoder().eval()
    x = _anisotropic_inputs(512, 64)
    errors = {}
    for name, example in (("plain", None), ("whitened", x)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            student = cc.optimize(copy.deepcopy(teacher), cc.CompressionConfig(budget=None,
                                                                               max_rank=6),
                                  example_inputs=example, init="dense", compile=False,
                                  format="lowrank")
        with torch.no_grad():
            errors[name] = float((student(x) - teacher(x)).square().sum()
                                 / teacher(x).square().sum())
    assert errors["whitened"] < errors["plain"]


def test_format_auto_picks_each_layers_format_by_output_error_and_says_why():
    from comera_compile.nn import TensorizedLayer

    torch.manual_seed(0)
    teacher = _Encoder().eval()
    x = _anisotropic_inputs(512, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        auto = cc.optimize(copy.deepcopy(teacher), 0.3, example_inputs=x, init="dense",
                           compile=False)  # the default for pretrained weights with inputs
        named = cc.optimize(copy.deepcopy(teacher), 0.3, example_inputs=x, init="dense",
                            compile=False, format="ttm")
    text = str(cc.summary(auto))
    for name in ("up", "down"):
        layer = auto.get_submodule(name)
        assert isinstance(layer, TensorizedLayer)
        assert f"format {layer.format}: least output error" in text
        line = next(s for s in text.splitlines() if s.strip().startswith(f"{name}: format"))
        errors = {part.split()[0]: float(part.split()[1])
                  for part in line.split("(", 1)[1].rsplit(")", 1)[0].split(", ")}
        assert errors[layer.format] == min(errors.values())
    assert all(named.get_submodule(n).format == "ttm" for n in ("up", "down"))  # named wins
    params = sum(p.numel() for p in auto.parameters())
    assert params <= 0.3 * sum(p.numel() for p in teacher.parameters()) * 1.01


# ----- embedding tables: rows weighted by how often they are looked up --------------------
def _zipf_ids(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Ids whose frequencies fall as 1/rank, over a shuffled vocabulary (fixed order)."""
    order = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))
    probs = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    draws = torch.multinomial(probs, rows, replacement=True,
                              generator=torch.Generator().manual_seed(seed + 1))
    return order[draws]


def test_weighted_lowrank_table_is_exact_at_full_rank_and_best_in_the_weighted_norm():
    from comera_compile.formats.whiten import row_weights, weighted_lowrank_table

    torch.manual_seed(0)
    table = torch.randn(300, 24, dtype=torch.float64)
    freq = torch.bincount(_zipf_ids(4000, 300, 0), minlength=300).double() / 4000
    a, b = weighted_lowrank_table(table, freq, 24)
    torch.testing.assert_close(a @ b, table)
    w = row_weights(freq)[:, None]
    a, b = weighted_lowrank_table(table, freq, 6)
    u, s, vh = torch.linalg.svd(table, full_matrices=False)
    plain = (u[:, :6] * s[:6]) @ vh[:6]
    weighted_err = float((w * (a @ b - table)).norm())
    plain_err = float((w * (plain - table)).norm())
    tail = torch.linalg.svdvals(w * table)[6:]  # Eckart-Young in the weighted norm
    assert weighted_err == pytest.approx(float(tail.norm()), rel=1e-9)
    assert weighted_err < 0.95 * plain_err


def test_optimize_weighs_table_rows_by_lookup_frequency_and_holds_on_other_batches(tmp_path):
    from comera_compile.nn import TTEmbedding

    class Bag(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Embedding(2000, 64)
            self.head = nn.Linear(64, 64)

        def forward(self, ids):
            return self.head(self.table(ids))

    torch.manual_seed(0)
    teacher = Bag().eval()
    calibration = _zipf_ids(2048, 2000, seed=0).reshape(32, 64)
    held_out = _zipf_ids(2048, 2000, seed=7).reshape(32, 64)  # other draws, same language
    errors, students = {}, {}
    for name, example in (("plain", None), ("weighted", calibration)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            students[name] = cc.optimize(copy.deepcopy(teacher), cc.CompressionConfig(budget=0.3,
                                                                                      exclude=["head"]),
                                         example_inputs=example, init="dense", compile=False,
                                         format="tt")
        with torch.no_grad():
            want = teacher.table(held_out)
            errors[name] = float((students[name].table(held_out) - want).norm() / want.norm())
    table = students["weighted"].table
    assert isinstance(table, TTEmbedding)
    assert list(table.row_modes) == [2000, 1] and list(table.col_modes) == [1, 64]
    assert errors["weighted"] < 0.85 * errors["plain"]
    assert "rows weighted by how often" in str(cc.summary(students["weighted"]))
    params = sum(p.numel() for p in students["weighted"].parameters())
    assert params <= 0.3 * sum(p.numel() for p in teacher.parameters()) * 1.01
    cc.save(students["weighted"], tmp_path)  # the low-rank layout loads back exactly
    loaded = cc.load(tmp_path, model=Bag()).eval()
    with torch.no_grad():
        assert torch.equal(loaded(held_out), students["weighted"](held_out))


def test_a_tied_table_counts_the_lookups_made_through_its_other_modules():
    """T5's ``shared`` table is looked up through ``encoder.embed_tokens`` and friends, other
    modules holding the same weight: their lookups are the table's frequencies."""
    from comera_compile.passes import find_candidates
    from comera_compile.passes.spectra import input_grams

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.shared = nn.Embedding(500, 32)
            self.encoder = nn.Embedding(500, 32)
            self.encoder.weight = self.shared.weight

        def forward(self, ids):
            return self.encoder(ids)

    model = Tied()
    table = next(c for c in find_candidates(model) if c.name == "shared")
    assert table.aliases == ["encoder"]
    ids = torch.tensor([[1, 1, 1, 7]])
    freq = input_grams(model, ids, [table])["shared"]
    assert freq.shape == (500,) and freq[1] == 0.75 and freq[7] == 0.25 and freq.sum() == 1
