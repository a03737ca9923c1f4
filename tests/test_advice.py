"""The summary's advice for from-scratch models: a narrower dense model, when the pretraining
frontier says it is the better buy, and only then."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import comera_compile as cc
from comera_compile.passes import advice

FRONTIER = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "frontier.md"


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))


def test_the_advice_names_the_parameter_matched_width(monkeypatch):
    monkeypatch.setattr(advice, "NARROW_DENSE_WINS", True)
    line = advice.narrow_dense_advice("random", 4_000_000, 1_000_000)
    assert "0.50x the width" in line and "1,000,000 parameters" in line
    assert advice.narrow_dense_advice("dense", 4_000_000, 1_000_000) == ""  # pretrained
    assert advice.narrow_dense_advice("random", 1_000_000, 1_000_000) == ""  # nothing cut
    monkeypatch.setattr(advice, "NARROW_DENSE_WINS", False)
    assert advice.narrow_dense_advice("random", 4_000_000, 1_000_000) == ""


def test_summary_gives_it_for_random_init_only(monkeypatch):
    monkeypatch.setattr(advice, "NARROW_DENSE_WINS", True)
    model = cc.optimize(mlp(), budget=0.25, compile=False)
    s = cc.summary(model)
    share = s.params_after / s.params_before
    assert f"{share ** 0.5:.2f}x the width" in s.advice
    assert "advice:" in str(s)
    x = torch.randn(8, 64)
    pretrained = cc.optimize(mlp(), budget=0.25, init="dense", example_inputs=(x,),
                             compile=False)
    assert "narrower" not in cc.summary(pretrained).advice
    assert "dense model of the same depth" not in cc.summary(pretrained).advice
    monkeypatch.setattr(advice, "NARROW_DENSE_WINS", False)
    assert "dense model of the same depth" not in cc.summary(model).advice


def test_the_flags_are_the_frontier_verdicts():
    """NARROW_DENSE_WINS: every row of the default ends above the best dense model at its end
    time; BEAT_DENSE: the formats with a row that ends below it (frontier.md's own lines)."""
    import re

    found = re.findall(r"^  ([\w-]+)@[\d.]+: ends at .*\(([+-])[\d.]+\)$",
                       FRONTIER.read_text(), flags=re.M)
    rows = [(fmt.removesuffix("-compiled"), sign) for fmt, sign in found]
    assert rows, "frontier.md has no per-row verdicts"
    assert advice.NARROW_DENSE_WINS == all(sign == "+" for fmt, sign in rows if fmt == "default")
    assert advice.BEAT_DENSE == {fmt for fmt, sign in rows if sign == "-" and fmt != "default"}


def test_no_advice_for_a_format_that_beat_dense(monkeypatch):
    monkeypatch.setattr(advice, "NARROW_DENSE_WINS", True)
    monkeypatch.setattr(advice, "BEAT_DENSE", frozenset({"btt"}))
    assert advice.narrow_dense_advice("random", 4_000_000, 1_000_000, {"btt"}) == ""
    assert "format='btt' did" in advice.narrow_dense_advice("random", 4_000_000, 1_000_000,
                                                            {"cola"})


def test_no_frontier_advice_where_only_embedding_tables_are_compressed(monkeypatch):
    """The race compares stacks of Linear layers: a recommender whose only compressed layers
    are its tables gets no 'narrower dense model' line, one with a compressed Linear does."""
    monkeypatch.setattr(advice, "NARROW_DENSE_WINS", True)
    monkeypatch.setattr(advice, "BEAT_DENSE", frozenset())
    torch.manual_seed(0)
    tables = nn.Sequential(nn.Embedding(4096, 64), nn.Linear(64, 512), nn.ReLU(),
                           nn.Linear(512, 64))
    only_table = cc.optimize(tables, cc.CompressionConfig(budget=0.5, exclude=["1", "3"],
                                                          compile=False))
    assert [r["format"] for r in cc.summary(only_table).records] == ["tt_embedding"]
    assert "dense model of the same depth" not in cc.summary(only_table).advice
    both = cc.optimize(tables, budget=0.5, compile=False)
    assert "dense model of the same depth" in cc.summary(both).advice
