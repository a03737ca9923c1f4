"""The step benchmark's summary over rounds: medians, ranges and ratios paired per round."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

STEP = Path(__file__).resolve().parents[1] / "benchmarks" / "step.py"


@pytest.fixture(scope="module")
def step():
    spec = importlib.util.spec_from_file_location("step_benchmark", STEP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(row: str, ms: float, mb: float, batch: int = 32) -> dict:
    return {"row": row, "batch": batch, "ms": ms, "memory_mb": mb, "faults": 0.0}


ROUNDS = [
    [_row("dense-eager", 8000.0, 3300.0), _row("comera-compiled", 1000.0, 1900.0),
     _row("comera-compiled-low", 1100.0, 1000.0)],
    [_row("dense-eager", 9000.0, 3300.0), _row("comera-compiled", 1500.0, 1900.0),
     _row("comera-compiled-low", 1500.0, 1100.0)],
    [_row("dense-eager", 7000.0, 3300.0), _row("comera-compiled", 1400.0, 1900.0),
     _row("comera-compiled-low", 1540.0, 1000.0)],
]


def test_median_over_rounds_takes_each_rows_median_and_range(step):
    merged = {r["row"]: r for r in step.median_over_rounds(ROUNDS)}
    assert merged["comera-compiled"]["ms"] == 1400.0
    assert merged["comera-compiled"]["ms_range"] == (1000.0, 1500.0)
    assert merged["comera-compiled-low"]["memory_mb"] == 1000.0
    assert merged["comera-compiled-low"]["memory_range"] == (1000.0, 1100.0)
    assert merged["dense-eager"]["rounds"] == 3


def test_ratios_are_paired_within_each_round(step):
    lines = step.paired_ratios(ROUNDS, 32)
    extra = next(line for line in lines if "extra time" in line)
    # per round: +10%, +0%, +10%, median +10%; the ratio of the rows' medians would be
    # 1500 / 1400, +7.1%, pairing one row's slow round with the other's fast one
    assert "+10.0% (median of 3 round(s): +10.0%, +0.0%, +10.0%)" in extra
    cut = next(line for line in lines if "memory cut" in line)
    assert "3.30x (median of 3 round(s): 3.30x, 3.00x, 3.30x)" in cut
    # no line for pairs whose rows did not run
    assert not any("galore" in line or "dense-inductor" in line for line in lines)
