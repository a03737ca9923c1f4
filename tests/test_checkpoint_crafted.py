"""Crafted checkpoints: whatever a directory holds, ``load`` ends in ``CheckpointError``
naming the problem or in a correct load, never another exception, and never reads a file
outside the directory. Named cases first, then hypothesis over manifests, layouts and
configs (``COMERA_PROPERTY_EXAMPLES`` scales the number of examples; CI runs the default)."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile

import pytest
import torch
from hf_models import VOCAB, bert
from safetensors.torch import load_file, save_file
from torch import nn

import comera_compile as cc
from comera_compile.io import MANIFEST, CheckpointError, _header_sha256, _sha256

hypothesis = pytest.importorskip(
    "hypothesis", reason="property tests need hypothesis: pip install 'comera_compile[dev]'")
st = pytest.importorskip("hypothesis.strategies")
given, settings, HealthCheck = hypothesis.given, hypothesis.settings, hypothesis.HealthCheck

EXAMPLES = int(os.environ.get("COMERA_PROPERTY_EXAMPLES", "150"))  # CI: the default, < 1 min
X = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))


def dense():
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))


class Saved:
    """A saved optimized MLP, the weights file outside it that must never be read, and
    what a correct load gives."""

    def __init__(self, root: str) -> None:
        torch.manual_seed(0)
        model = cc.optimize(dense(), 0.5, format="tt", compile=False)
        self.directory = os.path.join(root, "ckpt")
        cc.save(model, self.directory)
        with torch.no_grad():
            self.expected = model(X)
        with open(os.path.join(self.directory, MANIFEST)) as f:
            self.manifest = json.load(f)
        self.weights = load_file(os.path.join(self.directory, self.manifest["weights"]))
        self.bait = os.path.join(root, "elsewhere", "x.safetensors")
        os.makedirs(os.path.dirname(self.bait))
        shutil.copy(os.path.join(self.directory, self.manifest["weights"]), self.bait)

    def layout(self, name: str = "0") -> dict:
        return json.loads(bytes(self.weights[f"{name}._extra_state"].tolist()).decode())

    def write(self, directory: str, manifest=None, weights=None) -> None:
        """A copy of the checkpoint with another manifest and/or other tensors."""
        os.makedirs(directory, exist_ok=True)
        manifest = dict(self.manifest) if manifest is None else manifest
        if weights is not None:
            name = "model-0123456789ab.safetensors"
            save_file(weights, os.path.join(directory, name), metadata={"format": "pt"})
            if isinstance(manifest, dict):  # crafted consistently: sizes and hashes agree
                manifest = {**manifest, **hashes(os.path.join(directory, name)), "weights": name}
        else:
            name = self.manifest["weights"]
            shutil.copy(os.path.join(self.directory, name), os.path.join(directory, name))
        with open(os.path.join(directory, MANIFEST), "w") as f:
            f.write(manifest if isinstance(manifest, str) else json.dumps(manifest))


def hashes(path: str) -> dict:
    """The manifest's record of a weights file, as ``save`` writes it."""
    return {"weights_bytes": os.path.getsize(path), "sha256": _sha256(path),
            "header_sha256": _header_sha256(path)}


@pytest.fixture(scope="module")
def saved():
    with tempfile.TemporaryDirectory() as root:
        yield Saved(root)


opened: list[str] = []
_watching = [False]


def _audit(event: str, args) -> None:
    if _watching[0] and event == "open" and isinstance(args[0], str):
        opened.append(os.path.realpath(args[0]))


sys.addaudithook(_audit)


def load_and_judge(saved: Saved, directory: str) -> str:
    """``load``, which must end in ``CheckpointError`` or the saved model, reading nothing
    outside ``directory``."""
    opened.clear()
    _watching[0] = True
    try:
        model = cc.load(directory, model=dense())
    except CheckpointError as exc:
        return str(exc)
    finally:
        _watching[0] = False
        assert os.path.realpath(saved.bait) not in opened
    with torch.no_grad():
        assert torch.equal(model(X), saved.expected)
    return "loaded"


def with_layout(saved: Saved, layout) -> dict:
    data = layout if isinstance(layout, bytes) else json.dumps(layout).encode()
    return {**saved.weights, "0._extra_state": torch.tensor(list(data), dtype=torch.uint8)}


# ----- named cases -------------------------------------------------------------------------
def deep(n: int) -> str:
    return "[" * n + "]" * n


MANIFESTS = {
    "a list": ([1, 2], r"holds a JSON list, not an object"),
    "not JSON": ("{'weights':", r"not valid JSON"),
    "deeply nested": ('{"a": ' + deep(100000) + "}", r"not valid JSON \(RecursionError\)"),
    "no weights": ({"weights": None}, r"'weights' must be a file name"),
    "no aliases": ({"aliases": None}, r"'aliases' must be an object"),
    "an alias to nothing": ({"aliases": {"x": "missing"}}, r"ties 'x' to 'missing'"),
    "string size": ({"weights_bytes": "12"}, r"'weights_bytes' must be a byte count"),
    "unknown report keys": ({"report": {"evil": 1}}, r"'report' must be null or an object"),
    "a path up": ({"weights": "../elsewhere/x.safetensors"}, r"'weights' must be a file name"),
}


@pytest.mark.parametrize("case", sorted(MANIFESTS))
def test_crafted_manifest_raises_checkpoint_error_naming_it(saved, tmp_path, case):
    change, message = MANIFESTS[case]
    manifest = {**saved.manifest, **change} if isinstance(change, dict) else change
    if case == "no weights" or case == "no aliases":
        manifest = {k: v for k, v in saved.manifest.items() if k not in change}
    saved.write(str(tmp_path), manifest if not isinstance(manifest, list) else json.dumps(manifest))
    assert re.search(message, load_and_judge(saved, str(tmp_path)))


def test_absolute_or_linked_weights_outside_the_directory_are_never_read(saved, tmp_path):
    saved.write(str(tmp_path), {**saved.manifest, "weights": saved.bait})
    assert "'weights' must be a file name" in load_and_judge(saved, str(tmp_path))
    link = tmp_path / "model-0123456789ab.safetensors"
    link.symlink_to(saved.bait)
    saved.write(str(tmp_path), {**saved.manifest, "weights": link.name})
    assert "links outside" in load_and_judge(saved, str(tmp_path))


LAYOUTS = {
    "not UTF-8": (b"\xff\xfe\x00", r"layout of layer '0' .* not readable"),
    "deeply nested": (deep(100000).encode(), r"layout of layer '0' .* not readable"),
    "a JSON list": (["format", "tt"], r"layout of layer '0' .* not readable"),
    "no ranks": ("ranks", r"layout of layer '0' .* lacks 'ranks'"),
    "huge ranks": ({"ranks": [1, 10**9, 10**9, 10**9, 1]}, r"has ranks .* saved gates"),
    "huge modes": ({"in_modes": [10**6, 8]}, r"implies cores .* the weights hold"),
    "string rank": ({"ranks": [1, "8", 24, 16, 1]}, r"'ranks' = .* not positive integers"),
    "unknown format": ({"format": "evil"}, r"unknown format 'evil'"),
}


@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_crafted_layout_raises_checkpoint_error_naming_it(saved, tmp_path, case):
    change, message = LAYOUTS[case]
    layout = saved.layout()
    if isinstance(change, dict):
        layout = {**layout, **change}
    elif isinstance(change, str):
        del layout[change]
    else:
        layout = change
    saved.write(str(tmp_path), weights=with_layout(saved, layout))
    assert re.search(message, load_and_judge(saved, str(tmp_path)))


def test_unchanged_copy_loads(saved, tmp_path):
    saved.write(str(tmp_path), weights=with_layout(saved, saved.layout()))
    assert load_and_judge(saved, str(tmp_path)) == "loaded"


class Scaled(nn.Module):
    """A user's module with tensor extra state of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 256)
        self.scale = torch.tensor([1.0])

    def get_extra_state(self) -> torch.Tensor:
        return self.scale.clone()

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.scale = state.clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def test_a_models_own_tensor_extra_state_loads(tmp_path):
    torch.manual_seed(0)
    model = cc.optimize(nn.Sequential(Scaled(), nn.ReLU(), nn.Linear(256, 64)), 0.5,
                        compile=False)
    model[0].scale = torch.tensor([2.5])
    cc.save(model, tmp_path)
    loaded = cc.load(tmp_path, model=nn.Sequential(Scaled(), nn.ReLU(), nn.Linear(256, 64)))
    assert loaded[0].scale.item() == 2.5
    with torch.no_grad():
        assert torch.equal(loaded(X), model(X))


# ----- configs -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_bert():
    pytest.importorskip("transformers")
    with tempfile.TemporaryDirectory() as root:
        torch.manual_seed(0)
        cc.save(cc.optimize(bert()[0](), 0.1, compile=False), root)
        with open(os.path.join(root, "config.json")) as f:
            config = json.load(f)
        yield root, config


def with_config(saved_bert, directory: str, **change) -> str:
    root, config = saved_bert
    shutil.copytree(root, directory, dirs_exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({**config, **change}, f)
    with open(os.path.join(directory, MANIFEST)) as f:  # crafted consistently
        manifest = json.load(f)
    manifest["config_sha256"] = _sha256(os.path.join(directory, "config.json"))
    with open(os.path.join(directory, MANIFEST), "w") as f:
        json.dump(manifest, f)
    return directory


@pytest.mark.parametrize("name", ["pipeline", "TrainingArguments", "AutoModel", "BertConfig"])
def test_config_may_name_only_a_transformers_model_class(saved_bert, tmp_path, name):
    directory = with_config(saved_bert, str(tmp_path), architectures=[name])
    with pytest.raises(CheckpointError, match=rf"names no transformers model class.*{name}"):
        cc.load(directory)


def test_config_sizes_are_checked_against_the_weights_before_building(saved_bert, tmp_path):
    directory = with_config(saved_bert, str(tmp_path), vocab_size=10**12)
    with pytest.raises(CheckpointError, match=r"config.json gives .* shape \(1000000000000,\)"):
        cc.load(directory)  # a dense 10**12-row table would need terabytes
    assert cc.load(with_config(saved_bert, str(tmp_path / "ok"))).config.vocab_size == VOCAB


# ----- properties --------------------------------------------------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=True)
    | st.text(max_size=12)
    | st.sampled_from(["../elsewhere/x.safetensors", "/etc/passwd", "model.safetensors",
                       "model-0123456789ab.safetensors", "0.cores.0", "0.weight"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=3),
    max_leaves=8,
)
PROPERTY = settings(max_examples=EXAMPLES, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


@PROPERTY
@given(changes=st.dictionaries(
    st.sampled_from(["format_version", "weights", "weights_bytes", "aliases", "report",
                     "model_class", "extra"]), json_values, max_size=3),
    drop=st.sets(st.sampled_from(["weights", "weights_bytes", "aliases", "report"])),
    whole=st.none() | json_values)
def test_any_manifest_ends_in_checkpoint_error_or_a_correct_load(saved, changes, drop, whole):
    manifest = {k: v for k, v in {**saved.manifest, **changes}.items() if k not in drop}
    if whole is not None:
        manifest = whole
    with tempfile.TemporaryDirectory() as directory:
        saved.write(directory, json.dumps(manifest))
        load_and_judge(saved, directory)


LAYOUT_FIELDS = ["format", "ranks", "threshold", "in_features", "out_features", "in_modes",
                 "out_modes", "bias", "num_embeddings", "row_modes", "col_modes"]
small_ints = st.integers(-2, 300) | st.sampled_from([10**6, 10**12])


@settings(PROPERTY, max_examples=max(10, EXAMPLES * 2 // 3))  # each builds layers: dearer
@given(changes=st.dictionaries(
    st.sampled_from(LAYOUT_FIELDS),
    json_values | small_ints | st.lists(small_ints, max_size=5)
    | st.sampled_from(["tt", "ttm", "lowrank", "cola", "tt_embedding", "split_attention",
                       "tied_head"]), max_size=3),
    drop=st.sets(st.sampled_from(LAYOUT_FIELDS), max_size=2),
    raw=st.none() | st.binary(max_size=40),
    layer=st.sampled_from(["0", "2"]))
def test_any_layout_ends_in_checkpoint_error_or_a_correct_load(saved, changes, drop, raw, layer):
    layout = {k: v for k, v in {**saved.layout(layer), **changes}.items() if k not in drop}
    data = raw if raw is not None else json.dumps(layout).encode()
    weights = {**saved.weights,
               f"{layer}._extra_state": torch.tensor(list(data), dtype=torch.uint8)}
    with tempfile.TemporaryDirectory() as directory:
        saved.write(directory, weights=weights)
        load_and_judge(saved, directory)


@settings(max_examples=max(10, EXAMPLES // 10), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(architectures=st.none() | json_values | st.lists(st.sampled_from(
    ["BertForMaskedLM", "BertModel", "GPT2LMHeadModel", "pipeline", "TrainingArguments",
     "AutoModel", "PreTrainedModel", "BertConfig", "os", ""]), max_size=2),
    sizes=st.dictionaries(st.sampled_from(["vocab_size", "hidden_size", "intermediate_size",
                                           "num_hidden_layers", "max_position_embeddings"]),
                          small_ints | json_values, max_size=2))
def test_any_config_ends_in_checkpoint_error_or_a_correct_load(saved_bert, architectures, sizes):
    with tempfile.TemporaryDirectory() as directory:
        with_config(saved_bert, directory, architectures=architectures, **sizes)
        try:
            model = cc.load(directory)
        except CheckpointError:
            return
        reference = cc.load(saved_bert[0])
        for (name, got), want in zip(model.state_dict().items(), reference.state_dict().values()):
            assert torch.equal(got, want), name
