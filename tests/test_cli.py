"""The `comera` command: summary, plans (table and JSON), errors, and a short demo run."""

import json
import re
import sys

import pytest

from comera_compile import __version__
from comera_compile.cli import main, parse_budget_arg


def test_summary_prints_the_layer_table(capsys):
    assert main(["summary", "mlp", "--budget", "0.2"]) == 0
    out = capsys.readouterr().out
    assert " cola " in out  # from scratch: the default format
    assert "smaller" in out
    assert main(["summary", "mlp", "--budget", "0.2", "--format", "tt"]) == 0
    out = capsys.readouterr().out
    assert " tt " in out and " cola " not in out
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
    assert "parameter count (100000)" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_runs_end_to_end(tmp_path, capsys):
    assert main(["demo", "--steps", "12", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "test accuracy" in out and "late stage" in out
    assert (tmp_path / "history.csv").exists() and (tmp_path / "ranks.png").exists()


def _fails_fast(capsys, argv, *needles):
    """Exit status 2, one `comera: error:` line naming the fix, no traceback, raised before
    any optimize or training began."""
    import comera_compile.api
    import comera_compile.cli.demo

    began = []

    def refuse(name):
        def call(*args, **kwargs):
            began.append(name)
            raise RuntimeError(f"{name} ran")

        return call

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(comera_compile.api, "optimize", refuse("optimize"))
        patch.setattr(comera_compile.cli.demo, "run_demo", refuse("run_demo"))
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("comera: error: ")
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err
    assert began == []
    return err


def test_parameter_count_budget_is_a_count(capsys):
    assert main(["summary", "mlp", "--budget", "100000"]) == 0
    out = capsys.readouterr().out
    total = re.search(r"total parameters: ([\d,]+) -> ([\d,]+)", out)
    assert total is not None
    assert int(total.group(2).replace(",", "")) <= 100_000


@pytest.mark.parametrize(
    ("text", "expected"),
    [("100000", 100000), ("1e5", 100000), ("0.05", 0.05), ("5%", "5%"), ("40x", "40x"),
     ("20MB", "20MB")],
)
def test_budget_forms_the_command_line_takes(text, expected):
    assert parse_budget_arg(text) == expected


@pytest.mark.parametrize("text", ["20XB", "3.5", "-2", "0", "Budget(params=5)", "None"])
def test_bad_budget_lists_only_command_line_forms(capsys, text):
    err = _fails_fast(capsys, ["summary", "mlp", "--budget", text], "100000", "40x", "20MB")
    assert "None" not in err.replace(repr(text), "") and "Budget(" not in err.replace(text, "")


def test_factory_in_the_current_directory_is_found(tmp_path, monkeypatch, capsys):
    (tmp_path / "mymodels_cwd.py").write_text(
        "import torch\n"
        "def make_model():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),\n"
        "                               torch.nn.Linear(512, 256)), torch.randn(4, 256)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "mymodels_cwd", raising=False)
    assert main(["summary", "mymodels_cwd:make_model", "--budget", "0.2"]) == 0
    assert " cola " in capsys.readouterr().out


def test_builtin_spec_never_puts_the_current_directory_on_the_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    before = list(sys.path)
    assert main(["summary", "mlp"]) == 0
    assert sys.path == before
    monkeypatch.delitem(sys.modules, "nothing_here_cwd", raising=False)
    assert main(["summary", "nothing_here_cwd:make"]) == 2
    assert sys.path == [*before, str(tmp_path)]  # a module:factory spec appends it


def test_a_file_of_the_current_directory_is_never_run_in_place_of_a_module(tmp_path):
    """`comera summary mlp` imports getpass (through torch); ./getpass.py must not run."""
    import os
    import subprocess

    (tmp_path / "getpass.py").write_text("open('ran', 'w').close()\nraise SystemExit(9)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    code = "import sys; from comera_compile.cli import main; sys.exit(main(['summary', 'mlp']))"
    done = subprocess.run([sys.executable, "-P", "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not (tmp_path / "ran").exists()


def test_factory_returning_a_non_module(tmp_path, monkeypatch, capsys):
    (tmp_path / "notamodel_cwd.py").write_text("def make():\n    return 'oops'\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "notamodel_cwd", raising=False)
    _fails_fast(capsys, ["summary", "notamodel_cwd:make"], "returned a str", "nn.Module")


def test_plans_json_into_a_missing_folder_fails_first(tmp_path, capsys):
    target = tmp_path / "missing" / "plans.json"
    _fails_fast(capsys, ["plans", "six-encoder", "--json", str(target)], "does not exist")


def test_demo_out_onto_a_file_fails_first(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    _fails_fast(capsys, ["demo", "--out", str(blocker / "run")], "is a file")
    _fails_fast(capsys, ["demo", "--out", str(blocker)], "is a file")


@pytest.mark.parametrize(
    "argv",
    [["plans", "mlp", "--batch-sizes", "1,x"], ["demo", "--steps", "0"], ["nope"], []],
)
def test_argument_errors_read_comera_error(capsys, argv):
    _fails_fast(capsys, argv)


def test_help_shows_every_default_and_version(capsys):
    for command in ("plans", "summary", "demo"):
        assert main([command, "--help"]) == 0
        out = capsys.readouterr().out
        assert "``" not in out
        blocks = out.split("options:", 1)[1].split("\n  -")[1:]
        assert len(blocks) >= 2, out
        for block in blocks:
            if not block.startswith(("h, --help", "-quiet", "-json")):
                assert "default:" in block, (command, block)
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"comera {__version__}"
