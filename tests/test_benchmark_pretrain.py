"""The pretraining benchmark's ceiling for a compiled run: steps at the bound plus a compile."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

PRETRAIN = Path(__file__).resolve().parents[1] / "benchmarks" / "pretrain.py"


@pytest.fixture(scope="module")
def pretrain():
    spec = importlib.util.spec_from_file_location("pretrain_benchmark", PRETRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _eager(train_s: float, bound: float | None) -> dict:
    return {"curve": [(0, 0.0, 8.0), (300, train_s, 2.5)], "bound": bound}


def test_ceiling_adds_the_first_compile_to_steps_at_the_bound(pretrain):
    compiled = {"compiles": 1, "first_step_s": 30.6, "median_step_s": 0.6}
    line = pretrain.compiled_ceiling(_eager(150.0, 1.25), compiled)
    # 150 s of eager steps at 1.25x take 120 s, plus 30 s compiling: 150 / 150 = 1.00x
    assert "1.00x end to end" in line and "1.25x over eager" in line and "30 s" in line
    no_compile = {"compiles": 1, "first_step_s": 0.6, "median_step_s": 0.6}
    assert "1.25x end to end" in pretrain.compiled_ceiling(_eager(150.0, 1.25), no_compile)


def test_no_ceiling_without_a_compile_or_a_bound(pretrain):
    eager_run = {"compiles": 0, "first_step_s": 0.7, "median_step_s": 0.6}
    assert pretrain.compiled_ceiling(_eager(150.0, 1.25), eager_run) == ""
    compiled = {"compiles": 1, "first_step_s": 30.6, "median_step_s": 0.6}
    assert pretrain.compiled_ceiling(_eager(150.0, None), compiled) == ""
