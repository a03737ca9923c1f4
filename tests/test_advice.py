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
    monkeypatch.setattr(advice, "NARROW_DENSE_SHARE", 0.25)
    line = advice.narrow_dense_advice("random", 4_000_000, 1_000_000)
    assert "0.50x the width" in line and "1,000,000 parameters" in line and "25.0%" in line
    assert advice.narrow_dense_advice("dense", 4_000_000, 1_000_000) == ""  # pretrained
    assert advice.narrow_dense_advice("random", 1_000_000, 1_000_000) == ""  # nothing cut
    assert advice.narrow_dense_advice("random", 4_000_000, 1_000_001) == ""  # kept more
    monkeypatch.setattr(advice, "NARROW_DENSE_SHARE", None)
    assert advice.narrow_dense_advice("random", 4_000_000, 1_000_000) == ""


def test_summary_gives_it_for_random_init_only(monkeypatch):
    monkeypatch.setattr(advice, "NARROW_DENSE_SHARE", 0.5)
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
    monkeypatch.setattr(advice, "NARROW_DENSE_SHARE", None)
    assert "dense model of the same depth" not in cc.summary(model).advice


def test_the_flags_are_the_frontier_verdicts():
    """NARROW_DENSE_SHARE: at or above the kept share of every default row that lost both at
    its end time and against the dense row of equal parameters at the last step, and below
    the share of every default row that won; BEAT_DENSE: the formats with a row that ends
    below the best dense model at its end time (frontier.md's own lines)."""
    import re

    text = FRONTIER.read_text()
    found = re.findall(r"^  ([\w-]+@[\d.]+): ends at .*\(([+-])[\d.]+\)$", text, flags=re.M)
    assert found, "frontier.md has no per-row verdicts"
    params = {row: int(n.replace(",", "")) for row, n in
              re.findall(r"^([\w-]+@[\d.]+)(?: \(\w+\))? +([\d,]+) ", text, flags=re.M)}
    gaps = dict(re.findall(r"^([\w-]+@[\d.]+)(?: \(\w+\))? +dense@[\d.]+ .* 900 +([+-][\d.]+)$",
                           text, flags=re.M))
    share = {row: params[row] / params["dense@1"] for row, _ in found}
    default = [(row, sign == "+" and float(gaps.get(row, "+1")) > 0) for row, sign in found
               if row.split("@")[0].removesuffix("-compiled") == "default"]
    lost = [share[row] for row, loses in default if loses]
    won = [share[row] for row, loses in default if not loses]
    if lost and (not won or max(lost) < min(won)):
        assert max(lost) <= advice.NARROW_DENSE_SHARE < min(won, default=1.0)
    else:
        assert advice.NARROW_DENSE_SHARE is None or advice.NARROW_DENSE_SHARE < min(won)
    assert advice.BEAT_DENSE == {row.split("@")[0] for row, sign in found
                                 if sign == "-" and not row.startswith("default")}


def test_no_advice_for_a_format_that_beat_dense(monkeypatch):
    monkeypatch.setattr(advice, "NARROW_DENSE_SHARE", 0.5)
    monkeypatch.setattr(advice, "BEAT_DENSE", frozenset({"btt"}))
    assert advice.narrow_dense_advice("random", 4_000_000, 1_000_000, {"btt"}) == ""
    assert "0.50x the width" in advice.narrow_dense_advice("random", 4_000_000, 1_000_000,
                                                           {"cola"})


def test_no_frontier_advice_where_only_embedding_tables_are_compressed(monkeypatch):
    """The race compares stacks of Linear layers: a recommender whose only compressed layers
    are its tables gets no 'narrower dense model' line, one with a compressed Linear does."""
    monkeypatch.setattr(advice, "NARROW_DENSE_SHARE", 0.9)
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
