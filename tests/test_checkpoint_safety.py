"""Checkpoints from someone else: nothing in the directory runs, nothing outside it is read,
and every tensor, layout and record in it is checked against what ``save`` writes before
a model is built from it."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from hf_models import bert
from safetensors.torch import load_file, save_file
from torch import nn

import comera_compile as cc
from comera_compile.io import MANIFEST, CheckpointError, _header_sha256, _sha256
from comera_compile.nn import TensorizedLayer
from comera_compile.nn.base import decode_layout, encode_layout
from comera_compile.passes.report import report_of

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


# ----- a cc.save checkpoint, altered ----------------------------------------------------------
X = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64), nn.ReLU(),
                         nn.Linear(64, 64, bias=True))


@pytest.fixture(scope="module")
def saved_mlp(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlp")
    torch.manual_seed(0)
    model = cc.optimize(mlp(), cc.CompressionConfig(budget=0.5, format="cola", compile=False))
    model[4].bias.data = model[0].bias.data[:64].clone()  # equal shapes: an alias could join
    assert isinstance(model[0], TensorizedLayer) and isinstance(model[2], TensorizedLayer)
    cc.save(model, root)
    with torch.no_grad():
        return root, model(X)


def manifest_of(directory) -> dict:
    return json.loads((directory / MANIFEST).read_text())


def craft(saved_mlp, directory, change_tensors=None, **manifest_changes):
    """A copy of the checkpoint with other tensors (the manifest's sizes and hashes made to
    agree with the new file) and/or other manifest fields."""
    root, _ = saved_mlp
    directory = _copy(root, directory)
    manifest = manifest_of(directory)
    path = directory / manifest["weights"]
    if change_tensors is not None:
        tensors = load_file(path)
        change_tensors(tensors)
        save_file(tensors, path, metadata={"format": "pt"})
        manifest.update(weights_bytes=os.path.getsize(path), sha256=_sha256(str(path)),
                        header_sha256=_header_sha256(str(path)))
    manifest.update(manifest_changes)
    (directory / MANIFEST).write_text(json.dumps(manifest))
    return directory


def test_an_unaltered_copy_loads_exactly(saved_mlp, tmp_path):
    directory = craft(saved_mlp, tmp_path / "ckpt", lambda tensors: None)
    with torch.no_grad():
        assert torch.equal(cc.load(directory, model=mlp())(X), saved_mlp[1])


def test_flipped_bytes_in_the_data_are_caught_by_the_hash(saved_mlp, tmp_path):
    directory = _copy(saved_mlp[0], tmp_path / "ckpt")
    path = directory / manifest_of(directory)["weights"]
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    begin, end = json.loads(data[8:header])["0.cores.0"]["data_offsets"]
    data[header + (begin + end) // 2] ^= 0x40  # one core value: size and header unchanged
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"damaged or altered: its bytes differ"):
        cc.load(directory, model=mlp())
    loaded = cc.load(directory, model=mlp(), verify=False)  # the explicit opt-out
    with torch.no_grad():
        assert not torch.equal(loaded(X), saved_mlp[1])  # what the opt-out gives up


def test_without_hashing_the_file_its_header_is_still_checked(saved_mlp, tmp_path):
    def to_int(tensors):
        tensors["4.bias"] = tensors["4.bias"].view(torch.int32)  # same bytes, other dtype

    directory = craft(saved_mlp, tmp_path / "ckpt", to_int)
    manifest = manifest_of(saved_mlp[0])  # the hashes of the file as saved
    manifest["weights"] = manifest_of(directory)["weights"]
    (directory / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"its header \(names, dtypes, shapes\) differs"):
        cc.load(directory, model=mlp(), verify=False)


def test_an_alias_may_not_replace_a_saved_tensor(saved_mlp, tmp_path):
    directory = craft(saved_mlp, tmp_path / "ckpt", aliases={"4.bias": "0.bias"})
    with pytest.raises(CheckpointError, match=r"ties '4.bias' to '0.bias', but '4.bias' is "
                                              r"saved itself"):
        cc.load(directory, model=mlp())


def test_an_alias_may_only_join_tensors_the_model_ties(saved_mlp, tmp_path):
    directory = craft(saved_mlp, tmp_path / "ckpt", lambda tensors: tensors.pop("4.bias"),
                      aliases={"4.bias": "2.bias"})
    with pytest.raises(CheckpointError, match=r"ties '4.bias' to '2.bias', which Sequential "
                                              r"does not tie"):
        cc.load(directory, model=mlp())


@pytest.mark.parametrize("change", [{"format": "lowrank"}, {"format": "tt"},
                                    {"threshold": 0.5}, {"bias": False}])
def test_a_layout_must_be_the_one_the_manifest_recorded(saved_mlp, tmp_path, change):
    """CoLA, low rank and a TT of one mode per side have cores of the same shapes: only the
    manifest's record tells them apart."""

    def relabel(tensors):
        layout = decode_layout(tensors["0._extra_state"])
        tensors["0._extra_state"] = encode_layout({**layout, **change})

    directory = craft(saved_mlp, tmp_path / "ckpt", relabel)
    with pytest.raises(CheckpointError, match=r"layout of layer '0' in the weights file .* is "
                                              r"not the one comera.json recorded"):
        cc.load(directory, model=mlp())


@pytest.mark.parametrize("key, dtype, message", [
    ("0.cores.0", torch.float16, r"'0\.[\w.]+' is saved as torch.float(16|32), but "
                                 r"'0\.[\w.]+' of the same module is saved as"),
    ("0.bias", torch.bfloat16, r"'0.(bias|cores.0)' is saved as .*of the same module"),
    ("0.gates.0", torch.float16, r"'0.gates.0' is saved as torch.float16, but a rank gate"),
    ("4.bias", torch.int32, r"'4.bias' is saved as torch.int32, but the model holds "
                            r"torch.float32"),
    ("4.bias", torch.bool, r"'4.bias' is saved as torch.bool"),
    ("4.bias", torch.float8_e4m3fn, r"'4.bias' is saved as torch.float8_e4m3fn"),
])
def test_each_tensor_must_have_a_dtype_its_module_computes_with(saved_mlp, tmp_path, key,
                                                                 dtype, message):
    def cast(tensors):
        tensors[key] = tensors[key].to(dtype)

    directory = craft(saved_mlp, tmp_path / "ckpt", cast)
    with pytest.raises(CheckpointError, match=message):
        cc.load(directory, model=mlp())


def test_a_whole_model_cast_still_loads(tmp_path):
    torch.manual_seed(0)
    model = cc.optimize(mlp(), cc.CompressionConfig(budget=0.5, format="tt", compile=False))
    model = model.to(torch.bfloat16)  # rank gates stay float32 (gate_dtype)
    cc.save(model, tmp_path)
    loaded = cc.load(tmp_path, model=mlp())
    with torch.no_grad():
        assert torch.equal(loaded(X.bfloat16()), model(X.bfloat16()))


@pytest.mark.parametrize("report", [
    {"capture_reason": "no path"},
    {"capture_path": "fx", "capture_reason": "x", "originals": {"0": {"params": "many"}}},
    {"capture_path": "fx", "capture_reason": "x", "before": {"params": "many"}},
    {"capture_path": "fx", "capture_reason": "x", "skipped": {"0": 3}},
    {"capture_path": "fx", "capture_reason": "x", "config": {"budget": "evil"}},
    {"capture_path": 3, "capture_reason": "x"},
])
def test_a_report_that_does_not_fit_is_dropped_with_a_warning(saved_mlp, tmp_path, report):
    directory = craft(saved_mlp, tmp_path / "ckpt", report=report)
    with pytest.warns(UserWarning, match=r"the report in comera.json does not describe"):
        model = cc.load(directory, model=mlp())
    assert report_of(model) is None
    text = str(cc.summary(model))  # the live layers, without the report
    assert "cola" in text and cc.config_of(model) is None
    with torch.no_grad():
        assert torch.equal(model(X), saved_mlp[1])


def test_a_saved_report_loads_with_the_model(saved_mlp):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = cc.load(saved_mlp[0], model=mlp())
    assert report_of(model).capture_path == "fx"
    assert cc.config_of(model).format == "cola"


def test_a_lone_tensor_in_another_floating_dtype_is_refused(saved_bert, tmp_path):
    """A module of one tensor (the token type table) cast alone: no module-mate to compare with,
    but the rest of the checkpoint is float32."""
    directory = _copy(saved_bert, tmp_path / "ckpt")
    manifest = manifest_of(directory)
    path = directory / manifest["weights"]
    tensors = load_file(path)
    key = "bert.embeddings.token_type_embeddings.weight"
    tensors[key] = tensors[key].double()
    save_file(tensors, path, metadata={"format": "pt"})
    manifest.update(weights_bytes=os.path.getsize(path), sha256=_sha256(str(path)),
                    header_sha256=_header_sha256(str(path)))
    (directory / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=rf"'{key}' is saved as torch.float64, but the "
                                              r"model holds torch.float32 there and the "
                                              r"checkpoint mixes"):
        cc.load(directory)


def test_an_altered_config_is_refused(saved_bert, tmp_path):
    """config.json sets what the weights compute: an epsilon changed loads another model."""
    directory = _copy(saved_bert, tmp_path / "ckpt")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "layer_norm_eps": 1.0}))
    with pytest.raises(CheckpointError, match=r"config.json .* is not the one saved with the "
                                              r"weights"):
        cc.load(directory)


def _as_previous_format(directory) -> None:
    """Rewrite a manifest as the previous format wrote it: no hashes, no layouts."""
    path = directory / "comera.json"
    manifest = json.loads(path.read_text())
    keep = ("weights", "weights_bytes", "model_class", "aliases", "report")
    path.write_text(json.dumps({"format_version": 2, **{k: manifest[k] for k in keep}}))


def test_a_checkpoint_of_the_previous_format_loads_exactly_unverified(tmp_path):
    torch.manual_seed(0)
    dense = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(),
                                torch.nn.Linear(96, 64))
    model = cc.optimize(dense, budget=0.3, compile=False)
    cc.save(model, tmp_path)
    _as_previous_format(tmp_path)
    with pytest.raises(CheckpointError, match=r"verify=False"):
        cc.load(tmp_path, model=copy.deepcopy(dense))
    loaded = cc.load(tmp_path, model=copy.deepcopy(dense), verify=False)
    x = torch.randn(5, 64)
    assert torch.equal(loaded(x), model(x))
