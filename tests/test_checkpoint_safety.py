"""Checkpoints from someone else: nothing in the directory runs, nothing outside it is read,
and every tensor, layout and record in it is checked against what ``save`` writes before
a model is built from it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hf_models import bert

import comera_compile as cc
from comera_compile.io import CheckpointError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def saved_bert(tmp_path_factory):
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("bert")
    torch.manual_seed(0)
    cc.save(cc.optimize(bert()[0](), 0.1, compile=False), root)
    return root


REMOTE_CODE = textwrap.dedent("""
    import os
    from transformers import BertConfig
    open(os.path.join(os.path.dirname(__file__), "ran"), "w").close()

    class XConfig(BertConfig):
        model_type = "x"
""")


@pytest.mark.parametrize("field", ["auto_map", "custom_pipelines"])
@pytest.mark.parametrize("model_type", ["bert", "x"])
def test_remote_code_in_config_is_refused_without_a_prompt(saved_bert, tmp_path, field,
                                                           model_type):
    """Loading runs in a child with stdin open and nothing typed: a prompt would block it,
    an import would create the file ``ran``."""
    directory = tmp_path / "ckpt"
    directory.mkdir()
    for name in os.listdir(saved_bert):
        (directory / name).write_bytes((saved_bert / name).read_bytes())
    config = json.loads((directory / "config.json").read_text())
    config[field] = {"AutoConfig": "configuration_x.XConfig"}
    config["model_type"] = model_type  # "x": transformers knows no such type, so it asks
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "configuration_x.py").write_text(REMOTE_CODE)
    script = textwrap.dedent(f"""
        import comera_compile as cc
        from comera_compile.io import CheckpointError
        try:
            cc.load({str(directory)!r})
        except CheckpointError as exc:
            print("CheckpointError:", exc)
        else:
            print("loaded")
    """)
    env = {**os.environ, "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1"}
    log = tmp_path / "log"
    with open(log, "w") as out:
        child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                                 stdout=out, stderr=subprocess.STDOUT, text=True, env=env,
                                 cwd=str(tmp_path))
        try:
            child.wait(timeout=300)  # stdin stays open, nothing typed
        finally:
            child.kill()
            child.stdin.close()
    out = log.read_text()
    assert child.returncode == 0, out
    assert "CheckpointError:" in out and field in out, out
    assert "custom code" not in out  # never asked
    assert not (directory / "ran").exists()


def _copy(source, directory):
    directory.mkdir()
    for name in os.listdir(source):
        (directory / name).write_bytes((source / name).read_bytes())
    return directory


@pytest.mark.parametrize("name", ["comera.json", "config.json"])
def test_a_manifest_or_config_linking_outside_the_directory_is_refused(saved_bert, tmp_path,
                                                                       name):
    directory = _copy(saved_bert, tmp_path / "ckpt")
    outside = tmp_path / "elsewhere.json"
    outside.write_bytes((directory / name).read_bytes())
    (directory / name).unlink()
    (directory / name).symlink_to(outside)
    with pytest.raises(CheckpointError, match=rf"{name} links outside"):
        cc.load(directory)
