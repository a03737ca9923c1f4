"""The `comera` command: summary, plans (table and JSON), errors, and a short demo run."""

import json

from comera_compile.cli import main


def test_summary_prints_the_layer_table(capsys):
    assert main(["summary", "mlp", "--budget", "0.2"]) == 0
    out = capsys.readouterr().out
    assert " tt " in out
    assert "smaller" in out


def test_plans_write_json_records(tmp_path, capsys):
    path = tmp_path / "plans.json"
    assert main(["plans", "mlp", "--batch-sizes", "1,64", "--json", str(path)]) == 0
    records = json.loads(path.read_text())
    assert {r["batch_size"] for r in records} == {1, 64}
    assert all(r["macs"] > 0 and r["ratio"] < 1 for r in records if r["kind"] == "tt_linear")
    assert "order" in capsys.readouterr().out


def test_bad_spec_and_budget_exit_2_with_the_fix(capsys):
    assert main(["summary", "no-such-model"]) == 2
    assert "package.module:factory" in capsys.readouterr().err
    assert main(["summary", "mlp", "--budget", "20XB"]) == 2
    assert "accepted forms" in capsys.readouterr().err


def test_demo_runs_end_to_end(tmp_path, capsys):
    assert main(["demo", "--steps", "12", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "test accuracy" in out and "late stage" in out
    assert (tmp_path / "history.csv").exists() and (tmp_path / "ranks.png").exists()
