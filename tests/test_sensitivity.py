"""Output sensitivities: the estimator against the exact value, and what the allocator does
with them."""

import copy

import pytest
import torch
from torch import nn

import comera_compile as cc
from comera_compile.passes import find_candidates
from comera_compile.passes.sensitivity import FLOOR, output_sensitivities


class Branches(nn.Module):
    """``y = 2 a(x) + b(x)``, with ``c`` beside it unused by ``y`` (a second head)."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.a = nn.Linear(width, width, bias=False)
        self.b = nn.Linear(width, width, bias=False)
        self.c = nn.Linear(width, width, bias=False)
        self.b.weight.data.copy_(self.a.weight.data)  # the same weights: the same spectra

    def forward(self, x):
        self.side = self.c(x)
        return 2 * self.a(x) + self.b(x)


def test_sensitivity_matches_the_exact_value_of_a_linear_model():
    torch.manual_seed(0)
    model = Branches()
    x = torch.randn(256, 32)
    sens = output_sensitivities(model, x, find_candidates(model), probes=8)
    # y is linear in each branch: J = c I, so s = c^2 ||y_l||^2 / ||y||^2
    with torch.no_grad():
        y = model(x)
        exact = {name: (scale**2) * float(getattr(model, name)(x).square().sum())
                 / float(y.square().sum()) for name, scale in (("a", 2.0), ("b", 1.0))}
    mean = sum(exact.values()) / 2
    assert sens["a"] == pytest.approx(exact["a"] / mean, rel=0.03)
    assert sens["b"] == pytest.approx(exact["b"] / mean, rel=0.03)
    assert sens["c"] == 1.0  # the output does not reach it: nothing says it matters less


def test_sensitivity_leaves_the_model_as_it_was():
    model = Branches().requires_grad_(False)
    before = copy.deepcopy(model.state_dict())
    output_sensitivities(model.train(), torch.randn(8, 32), find_candidates(model))
    assert model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_padded_tokens_do_not_count():
    """Features laid out (batch, tokens, ...) count at the attention mask's real tokens."""
    torch.manual_seed(0)

    class Tokens(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, input_ids, attention_mask):
            x = torch.nn.functional.one_hot(input_ids, 8).float()
            return self.a(x) + self.b(x)

    model = Tokens()
    ids = torch.randint(7, (4, 6))
    mask = torch.ones(4, 6, dtype=torch.long)
    mask[:, 3:] = 0
    ids[:, 3:] = 7  # the padding id, which b alone maps to something huge
    with torch.no_grad():
        model.b.weight[:, 7] = 100.0
    full = output_sensitivities(model, {"input_ids": ids, "attention_mask": mask},
                                find_candidates(model))
    trimmed = output_sensitivities(model, {"input_ids": ids[:, :3],
                                           "attention_mask": mask[:, :3]},
                                   find_candidates(model))
    assert full == pytest.approx(trimmed, rel=1e-5)


def test_the_allocator_gives_the_felt_layer_more_rank():
    torch.manual_seed(0)
    model = Branches(48)
    x = torch.randn(512, 48)
    small = cc.optimize(copy.deepcopy(model), cc.CompressionConfig(budget=0.5, include=["a", "b"]),
                        init="dense", example_inputs=x, compile=False, format="lowrank",
                        inplace=True)
    rank_a = small.a.ranks[1] if hasattr(small.a, "ranks") else 48
    rank_b = small.b.ranks[1] if hasattr(small.b, "ranks") else 48
    assert rank_a > rank_b  # same weights, same inputs: only how much y feels them differs


def test_a_layer_the_output_barely_feels_keeps_a_floor():
    torch.manual_seed(0)
    model = Branches()
    with torch.no_grad():
        model.b.weight.mul_(1e-6)
    sens = output_sensitivities(model, torch.randn(64, 32), find_candidates(model))
    assert sens["b"] == FLOOR and sens["a"] > 1


def test_no_float_output_gives_no_sensitivities():
    class Ids(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x):
            return self.a(x).argmax(-1)

    model = Ids()
    assert output_sensitivities(model, torch.randn(3, 4), find_candidates(model)) == {}


@pytest.mark.parametrize("fmt, weighed", [("lowrank", True), ("tt", True), ("ttm", False)])
def test_only_output_errors_are_weighed_and_the_summary_shows_it(fmt, weighed):
    """Whitened spectra (TT, low rank) give output errors, which a sensitivity scales; a TTM
    spectrum is the weight's error and keeps its old weight."""
    torch.manual_seed(0)
    model = Branches(48)
    small = cc.optimize(copy.deepcopy(model), cc.CompressionConfig(budget=0.5, include=["a", "b"]),
                        init="dense", example_inputs=torch.randn(
        256, 48), compile=False,
                        format=fmt, inplace=True)
    records = {r["name"]: r for r in cc.summary(small).records}
    assert records
    assert all((r["sensitivity"] is not None) == weighed for r in records.values())
    assert ("felt: how much" in str(cc.summary(small))) == weighed
