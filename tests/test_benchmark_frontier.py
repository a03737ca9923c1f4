"""The pretraining frontier benchmark: its arithmetic on synthetic curves, its rows and
command line, and the script end to end at a tiny shape (the CPU race and the GPU form's
code on the CPU)."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FRONTIER = ROOT / "benchmarks" / "frontier.py"
TINY = ["--layers", "1", "--hidden", "32", "--ffn", "64", "--heads", "2", "--seq", "16",
        "--batch", "2", "--steps", "6", "--warmup", "2", "--eval-every", "3",
        "--early-step", "3", "--val-batches", "1", "--corpus-bytes", "60000", "--threads", "1"]


@pytest.fixture(scope="module")
def frontier():
    spec = importlib.util.spec_from_file_location("frontier_benchmark", FRONTIER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row(curve: list, mb: float = 100.0) -> dict:
    return {"curve": curve, "train_mb": mb, "formats": [], "params": 1}


# dense@1: slow, best at the end; dense@0.5: fast, plateaus; cola@0.5: in between
SYNTHETIC = {
    "dense@1": row([(0, 0.0, 8.0), (100, 100.0, 3.0), (200, 200.0, 2.0)], mb=300),
    "dense@0.5": row([(0, 0.0, 8.0), (100, 20.0, 3.5), (200, 40.0, 3.0)], mb=100),
    "cola@0.5": row([(0, 0.0, 8.0), (100, 30.0, 3.2), (200, 60.0, 2.8)], mb=150),
}


def test_a_row_is_interpolated_and_keeps_its_final_value_after_its_end(frontier):
    curve = SYNTHETIC["dense@0.5"]["curve"]
    assert frontier.value_at(curve, 10.0) == pytest.approx(5.75)
    assert frontier.value_at(curve, 30.0) == pytest.approx(3.25)
    assert frontier.value_at(curve, 500.0) == 3.0
    assert frontier.value_at_step(curve, 150) == pytest.approx(3.25)
    assert frontier.value_at_step(curve, 900) == 3.0


def test_time_frontier_takes_the_best_row_of_each_family_at_each_time(frontier):
    front = frontier.time_frontier(SYNTHETIC, [20.0, 60.0, 150.0])
    t, d_row, d_bpb, c_row, c_bpb = front[0]
    assert (t, d_row, d_bpb, c_row) == (20.0, "dense@0.5", 3.5, "cola@0.5")
    assert c_bpb == pytest.approx(8.0 + (3.2 - 8.0) * 20 / 30)
    # at 60 s the narrow model has ended at 3.0; the wide one is at 8 - 5 * 0.6 = 5.0
    assert front[1][1:] == ("dense@0.5", 3.0, "cola@0.5", 2.8)
    assert front[2][1:3] == ("dense@1", 2.5)


def test_memory_frontier_counts_only_rows_that_fit(frontier):
    mem = frontier.memory_frontier(SYNTHETIC)
    assert [m[0] for m in mem] == [100, 150, 300]
    assert mem[0][1:3] == ("dense@0.5", 3.0) and mem[0][3] == "-" and math.isnan(mem[0][4])
    assert mem[1][1:] == ("dense@0.5", 3.0, "cola@0.5", 2.8)
    assert mem[2][1:] == ("dense@1", 2.0, "cola@0.5", 2.8)


def test_verdict_compares_each_compressed_row_with_the_dense_frontier_at_its_end(frontier):
    rows, wins = frontier.verdicts(SYNTHETIC)
    assert wins  # at 60 s cola (2.8) is below both dense rows (3.0 and 5.0)
    (name, end, final, d_row, d_bpb, gap), = rows
    assert (name, end, final, d_row, d_bpb) == ("cola@0.5", 60.0, 2.8, "dense@0.5", 3.0)
    assert gap == pytest.approx(-0.2)
    slower = dict(SYNTHETIC, **{"cola@0.5": row([(0, 0.0, 8.0), (200, 150.0, 2.8)])})
    rows, wins = frontier.verdicts(slower)
    assert not wins and rows[0][3] == "dense@1"  # dense@1 is at 2.5 by 150 s


def test_the_median_clock_puts_each_step_at_the_rows_median_step(frontier):
    bursty = {"r": dict(row([(0, 0.0, 8.0), (100, 400.0, 3.0), (200, 450.0, 2.0)]),
                        median_step_s=0.5)}
    assert frontier.retimed(bursty, "median")["r"]["curve"] == [
        (0, 0.0, 8.0), (100, 50.0, 3.0), (200, 100.0, 2.0)]
    assert frontier.retimed(bursty, "elapsed") is bursty


def test_dense_widths_keep_depth_and_head_width(frontier):
    args = frontier.parse_args([])
    assert (args.layers, args.hidden, args.ffn, args.heads, args.seq, args.batch,
            args.steps, args.lr, args.warmup, args.schedule) == (
        4, 384, 1024, 6, 128, 16, 900, 1e-3, 30, "constant")
    assert frontier.dense_shape(args, 1.0) == (384, 1024, 6)
    assert frontier.dense_shape(args, 0.75) == (288, 768, 4)
    assert frontier.dense_shape(args, 0.5) == (192, 512, 3)
    assert frontier.dense_shape(args, 0.25) == (96, 256, 2)
    counts = [frontier.count(frontier.dense_model(args, w)) for w in (1, 0.75, 0.5, 0.25)]
    assert counts == sorted(counts, reverse=True)
    assert counts[2] == pytest.approx(counts[0] / 4, rel=0.1)  # params go as width squared


def test_rows_skip_formats_the_package_lacks(frontier, monkeypatch, capsys):
    monkeypatch.setattr(frontier, "available_formats", lambda: {"cola", "lowrank"})
    args = frontier.parse_args(["--widths", "1,0.5", "--match", "0.5",
                                "--formats", "default,lowrank,btt"])
    assert frontier.plan_rows(args) == ["dense@1", "dense@0.5", "default@0.5", "lowrank@0.5"]
    assert "'btt' is not in this package" in capsys.readouterr().out


def test_gpu_flag_presets_the_60m_shape(frontier):
    args = frontier.parse_args(["--gpu"])
    assert (args.hidden, args.ffn, args.layers, args.heads, args.vocab, args.seq) == (
        512, 1376, 8, 8, 32000, 256)
    assert args.bf16 and args.device == "cuda" and args.results_name == "frontier_cuda"
    args = frontier.parse_args(["--gpu", "--device", "cpu", "--hidden", "64", "--no-bf16"])
    assert (args.hidden, args.device, args.bf16) == (64, "cpu", False)
    with pytest.raises(SystemExit):
        frontier.parse_args(["--hidden", "100", "--heads", "6"])


def run(args: list[str]) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, str(FRONTIER), *args], capture_output=True,
                         text=True, cwd=ROOT, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_the_race_end_to_end_at_a_tiny_shape(tmp_path):
    run([*TINY, "--rows", "dense@1,default@0.5", "--json", str(tmp_path / "f.json"),
        "--img-dir", str(tmp_path), "--results-name", "tiny"])
    raw = json.loads((tmp_path / "f.json").read_text())
    dense, default = raw["rows"]["dense@1"], raw["rows"]["default@0.5"]
    assert [p[0] for p in dense["curve"]] == [0, 3, 6]
    assert default["formats"] and default["params"] < dense["params"] / 2
    assert all(r["train_mb"] > 0 for r in raw["rows"].values())
    assert dense["curve"][-1][2] < dense["curve"][0][2]  # it learns, even in six steps
    text = (tmp_path / "tiny.md").read_text()
    assert "Verdict:" in text and "Python stdlib" in text and "/lib/python" not in text
    assert "Equal parameters" not in text  # no dense row of default@0.5's size ran
    assert (tmp_path / "tiny_time.png").stat().st_size > 1000
    assert (tmp_path / "tiny_memory.png").stat().st_size > 1000
    again = run([*TINY, "--rows", "dense@1,dense@0.5", "--json", str(tmp_path / "f.json"),
                 "--report-only", "--img-dir", str(tmp_path), "--results-name", "tiny"])
    assert "reusing 1 rows" in again.stdout  # nothing ran again
    assert "dense@0.5: not run" in (tmp_path / "tiny.md").read_text()


def test_a_row_that_cannot_run_is_reported_with_its_reason(tmp_path):
    """A failed row is kept in the raw file with its error, so a later report says why it is
    missing rather than "not run"."""
    args = [*TINY, "--json", str(tmp_path / "f.json"), "--img-dir", str(tmp_path),
            "--results-name", "tiny", "--no-plot"]
    run([*args, "--rows", "dense@1,btt@0.01", "--resume"])  # BTT cannot get that small
    raw = json.loads((tmp_path / "f.json").read_text())
    assert "BudgetUnreachable" in raw["rows"]["btt@0.01"]["failed"]
    again = run([*args, "--rows", "dense@1,btt@0.01", "--report-only"])
    assert "failed, left out" in again.stdout or "failed, left out" in (
        tmp_path / "tiny.md").read_text()
    assert "btt@0.01: not run" not in (tmp_path / "tiny.md").read_text()


def test_the_gpu_form_runs_on_the_cpu_at_a_tiny_shape(tmp_path):
    out = run(["--gpu", "--device", "cpu", *TINY, "--vocab", "300", "--budget", "0.6",
               "--rows", "dense,default", "--no-write"])
    lines = out.stdout.splitlines()
    assert any(line.startswith("dense ") for line in lines)
    assert any(line.startswith("default (") for line in lines)
    assert "tokens/s" in out.stdout and "speed vs dense" in out.stdout


def test_the_readme_pretraining_numbers_are_the_frontier_files():
    readme = (ROOT / "README.md").read_text()
    part = readme.split("## Results", 1)[1].split("\nTraining memory", 1)[0]
    assert "benchmarks/results/frontier.md" in part
    results = (ROOT / "benchmarks" / "results" / "frontier.md").read_text()
    for number in re.findall(r"\d+\.\d+|\d{2,}", part):
        assert number in results, number
