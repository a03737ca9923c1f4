"""Fuzzing ``load``: mutated manifests, layouts, ``config.json`` and weight bytes of three
kinds of model (an MLP, an embedding model, a Hugging Face BERT), each ending in
``CheckpointError`` or in an exact load, whose ``summary`` and first forward then run; no
other exception may escape.

Damage (bytes changed, the manifest's hashes left as saved) must be caught whatever it hits.
A crafted weights file (its sizes and hashes made to agree) changes structure only: a
layout, a header, a tensor's dtype, shape or name. Crafting new values with matching hashes
writes another valid checkpoint, which no check can tell from the saved one, so it is not
drawn; nor can a ``config.json`` crafted with its hash (``layer_norm_eps=1.0`` is another
model): such a load must end in ``CheckpointError`` or in a model whose summary and forward
run, without the saved model's outputs. Bounded for CI (``COMERA_PROPERTY_EXAMPLES`` scales
it; the default runs in well under a minute).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import comera_compile as cc
from comera_compile.io import HF_CONFIG, MANIFEST, CheckpointError, _header_sha256, _sha256
from comera_compile.nn.base import decode_layout, encode_layout

hypothesis = pytest.importorskip(
    "hypothesis", reason="property tests need hypothesis: pip install 'comera_compile[dev]'")
st = pytest.importorskip("hypothesis.strategies")
given, settings, HealthCheck = hypothesis.given, hypothesis.settings, hypothesis.HealthCheck

SCALE = int(os.environ.get("COMERA_PROPERTY_EXAMPLES", "150")) / 150
EXAMPLES = {"mlp": 60, "embedding": 50, "bert": 30}


class EmbeddingModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(4096, 64)
        self.head = nn.Linear(64, 256)
        self.out = nn.Linear(256, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.head(self.table(ids).mean(1))))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 16))


def _bert() -> nn.Module:
    from hf_models import bert

    return bert()[0]()


BUILD = {"mlp": _mlp, "embedding": EmbeddingModel, "bert": _bert}
IDS = torch.randint(0, 4096, (4, 6), generator=torch.Generator().manual_seed(0))
INPUTS = {"mlp": (torch.randn(3, 64, generator=torch.Generator().manual_seed(0)),),
          "embedding": (IDS,), "bert": (IDS.clamp(max=999),)}
CONFIGS = {
    "mlp": cc.CompressionConfig(budget=0.5, format="tt", compile=False),
    "embedding": cc.CompressionConfig(budget=0.3, compile=False),
    "bert": cc.CompressionConfig(budget=0.1, compile=False),
}


def _out(model: nn.Module, kind: str) -> torch.Tensor:
    with torch.no_grad():
        out = model.eval()(*INPUTS[kind])
    return getattr(out, "logits", out)


class Saved:
    """A saved optimized model and what an exact load of it gives."""

    def __init__(self, kind: str, root: str) -> None:
        self.kind = kind
        torch.manual_seed(0)
        model = cc.optimize(BUILD[kind](), CONFIGS[kind])
        self.directory = os.path.join(root, "saved")
        cc.save(model, self.directory)
        self.expected = _out(model, kind)
        self.state = {k: v for k, v in model.state_dict().items()
                      if not k.endswith("_extra_state")}
        with open(os.path.join(self.directory, MANIFEST)) as f:
            self.manifest = json.load(f)
        self.weights = os.path.join(self.directory, self.manifest["weights"])
        self.tensors = load_file(self.weights)
        with open(self.weights, "rb") as f:
            self.raw = f.read()
        self.header = 8 + int.from_bytes(self.raw[:8], "little")
        self.config = None
        if kind == "bert":
            with open(os.path.join(self.directory, HF_CONFIG)) as f:
                self.config = json.load(f)
        assert self.manifest["layouts"], "the model must hold tensorized layers"

    def load(self, directory: str, verify: bool) -> nn.Module:
        model = None if self.kind == "bert" else BUILD[self.kind]()
        return cc.load(directory, model=model, verify=verify)


def _saved(kind: str):
    @pytest.fixture(scope="module")
    def fixture():
        if kind == "bert":
            pytest.importorskip("transformers")
        with tempfile.TemporaryDirectory() as root:
            yield Saved(kind, root)

    return fixture


saved_mlp, saved_embedding, saved_bert = (_saved(k) for k in ("mlp", "embedding", "bert"))


# ----- what is drawn ------------------------------------------------------------------------
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=True)
    | st.text(max_size=8)
    | st.sampled_from(["../x.safetensors", "/etc/passwd", "model.safetensors", "tt", "cola",
                       "lowrank", "bert", "BertForMaskedLM", "0" * 64]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=3),
    max_leaves=6,
)
SMALL = st.integers(-2, 300) | st.sampled_from([10**6, 10**12])
LAYOUT_VALUES = (JSON | SMALL | st.lists(SMALL, max_size=5)
                 | st.sampled_from(["tt", "ttm", "lowrank", "cola", "tt_embedding",
                                    "split_attention", "tied_head"]))
PLAUSIBLE = {  # values save could have written: they reach the checks past the parsing
    "format": st.sampled_from(["tt", "ttm", "lowrank", "cola", "tt_embedding"]),
    "threshold": st.floats(0, 2),
    "bias": st.booleans(),
}
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32,
          torch.int64, torch.int8, torch.uint8, torch.bool]


def _rehash(directory: str, manifest: dict, name: str) -> dict:
    path = os.path.join(directory, name)
    return {**manifest, "weights": name, "weights_bytes": os.path.getsize(path),
            "sha256": _sha256(path), "header_sha256": _header_sha256(path)}


def _write(saved: Saved, directory: str, manifest, raw: bytes | None = None,
           tensors: dict | None = None, rehash: bool = False, config=None) -> None:
    """A copy of the saved checkpoint with some of its parts replaced."""
    shutil.copytree(saved.directory, directory, dirs_exist_ok=True)
    name = saved.manifest["weights"]
    path = os.path.join(directory, name)
    if tensors is not None:
        save_file(tensors, path, metadata={"format": "pt"})
    elif raw is not None:
        with open(path, "wb") as f:
            f.write(raw)
    if rehash and isinstance(manifest, dict):
        manifest = _rehash(directory, manifest, name)
    with open(os.path.join(directory, MANIFEST), "w") as f:
        f.write(manifest if isinstance(manifest, str) else json.dumps(manifest))
    if config is not None:
        with open(os.path.join(directory, HF_CONFIG), "w") as f:
            f.write(config if isinstance(config, str) else json.dumps(config))


def _manifest_value(saved: Saved, data, field: str):
    keys = sorted(saved.state)
    plausible = {
        "aliases": st.dictionaries(st.sampled_from(keys), st.sampled_from(keys), max_size=2),
        "weights_bytes": st.integers(len(saved.raw) - 2, len(saved.raw) + 2),
        "sha256": st.sampled_from([saved.manifest["header_sha256"], "a" * 64]),
        "header_sha256": st.sampled_from([saved.manifest["sha256"], "b" * 64]),
        "format_version": st.integers(1, 4),
        "layouts": st.just(None),  # replaced below: one recorded layout altered
        "report": st.sampled_from([None, {}, {"capture_path": "fx"}]),
    }
    if field == "layouts":
        layouts = json.loads(json.dumps(saved.manifest["layouts"]))
        name = data.draw(st.sampled_from(sorted(layouts)))
        layouts[name][data.draw(st.sampled_from(sorted(layouts[name])))] = data.draw(
            LAYOUT_VALUES)
        return layouts
    if field == "report" and saved.manifest.get("report"):
        report = dict(saved.manifest["report"])
        report[data.draw(st.sampled_from(sorted(report)))] = data.draw(JSON)
        return data.draw(st.sampled_from([report, None]))
    return data.draw(plausible.get(field, JSON) | JSON)


def mutate_manifest(saved: Saved, data, directory: str) -> bool:
    fields = sorted({*saved.manifest, "extra"})
    changes = data.draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3, unique=True))
    manifest = dict(saved.manifest)
    for field in changes:
        if data.draw(st.booleans()):
            manifest.pop(field, None)
        else:
            manifest[field] = _manifest_value(saved, data, field)
    if data.draw(st.integers(0, 9)) == 0:
        manifest = data.draw(JSON)
    _write(saved, directory, manifest)
    return data.draw(st.booleans())


def mutate_layout(saved: Saved, data, directory: str) -> bool:
    """A layer's layout altered in the weights file, its hashes made to agree."""
    name = data.draw(st.sampled_from(sorted(saved.manifest["layouts"])))
    key = f"{name}._extra_state" if name else "_extra_state"
    layout = decode_layout(saved.tensors[key])
    for field in data.draw(st.lists(st.sampled_from(sorted({*layout, "format", "ranks",
                                                            "threshold", "bias"})),
                                    min_size=1, max_size=3, unique=True)):
        how = data.draw(st.sampled_from(["drop", "any", "plausible"]))
        if how == "drop":
            layout.pop(field, None)
        else:
            values = PLAUSIBLE.get(field, LAYOUT_VALUES) if how == "plausible" else LAYOUT_VALUES
            layout[field] = data.draw(values)
    raw = data.draw(st.none() | st.binary(max_size=40)) if data.draw(st.booleans()) else None
    value = (torch.tensor(list(raw), dtype=torch.uint8) if raw is not None
             else encode_layout(layout))
    _write(saved, directory, dict(saved.manifest), tensors={**saved.tensors, key: value},
           rehash=data.draw(st.booleans()))
    return data.draw(st.booleans())


def mutate_tensors(saved: Saved, data, directory: str) -> bool:
    """A tensor's dtype, shape or name changed (never its values), hashes made to agree."""
    tensors = dict(saved.tensors)
    key = data.draw(st.sampled_from(sorted(tensors)))
    how = data.draw(st.sampled_from(["cast", "reshape", "drop", "rename", "extra"]))
    if how == "cast":
        tensors[key] = tensors[key].to(data.draw(st.sampled_from(DTYPES)))
    elif how == "reshape":
        tensors[key] = tensors[key].reshape(-1) if tensors[key].dim() != 1 else (
            tensors[key].unsqueeze(0))
    elif how == "drop":
        del tensors[key]
    elif how == "rename":
        tensors[data.draw(st.sampled_from([key + "x", "x." + key, "cores.0"]))] = tensors.pop(key)
    else:
        tensors[data.draw(st.text("abc.0", min_size=1, max_size=8))] = torch.zeros(2)
    _write(saved, directory, dict(saved.manifest), tensors=tensors, rehash=True)
    return data.draw(st.booleans())


def mutate_bytes(saved: Saved, data, directory: str) -> bool:
    """Damage: bytes changed, cut or added, the manifest as saved. Only changes to the
    header may also come with matching hashes (a crafted header)."""
    raw = bytearray(saved.raw)
    region = data.draw(st.sampled_from(["header", "data", "any"]))
    low, high = {"header": (0, saved.header), "data": (saved.header, len(raw)),
                 "any": (0, len(raw))}[region]
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(low, high - 1))
        how = data.draw(st.sampled_from(["xor", "set", "cut", "add"]))
        if how == "xor":
            raw[at] ^= 1 << data.draw(st.integers(0, 7))
        elif how == "set":
            raw[at] = data.draw(st.integers(0, 255))
        elif how == "cut":
            del raw[at:]
            break
        else:
            raw[at:at] = data.draw(st.binary(min_size=1, max_size=8))
    crafted = region == "header" and data.draw(st.booleans())
    _write(saved, directory, dict(saved.manifest), raw=bytes(raw), rehash=crafted)
    return data.draw(st.booleans()) if region == "header" else True


def mutate_config(saved: Saved, data, directory: str) -> bool | None:
    """Damaged (the manifest's config_sha256 as saved), or crafted with a matching hash:
    then None, for a load that need not be exact."""
    config = dict(saved.config)
    fields = sorted({*config, "auto_map", "custom_pipelines", "trust_remote_code"})
    for field in data.draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3,
                                    unique=True)):
        if data.draw(st.booleans()):
            config.pop(field, None)
        else:
            config[field] = data.draw(SMALL | JSON | st.sampled_from(
                [["BertForMaskedLM"], ["BertModel"], ["GPT2LMHeadModel"], ["AutoModel"],
                 {"AutoConfig": "configuration_x.XConfig"}, "bert", "gpt2", "x"]))
    if data.draw(st.integers(0, 9)) == 0:
        config = data.draw(JSON)
    _write(saved, directory, dict(saved.manifest), config=config)
    if not data.draw(st.booleans()):
        return True
    path = os.path.join(directory, HF_CONFIG)
    _write(saved, directory, {**saved.manifest, "config_sha256": _sha256(path)}, config=config)
    return None


MUTATIONS = {"manifest": mutate_manifest, "layout": mutate_layout, "tensors": mutate_tensors,
             "bytes": mutate_bytes, "config": mutate_config}


def judge(saved: Saved, directory: str, verify: bool | None) -> str:
    """CheckpointError, or the saved model exactly (any valid model where ``verify`` is
    None: a crafted config); its summary and forward run."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a dropped report warns
        try:
            model = saved.load(directory, verify is not False)
        except CheckpointError:
            return "refused"
        str(cc.summary(model))
        got = _out(model, saved.kind)
    if verify is None:
        return "another model"
    assert torch.equal(got, saved.expected)
    state = model.state_dict()
    for key, value in saved.state.items():
        assert torch.equal(state[key], value), key
    return "loaded"


def fuzz(saved: Saved, data) -> None:
    kinds = sorted(MUTATIONS) if saved.config is not None else sorted(
        set(MUTATIONS) - {"config"})
    mutation = data.draw(st.sampled_from(kinds))
    with tempfile.TemporaryDirectory() as directory:
        verify = MUTATIONS[mutation](saved, data, directory)
        judge(saved, directory, verify)


def bounded(kind: str) -> settings:
    return settings(max_examples=max(5, int(EXAMPLES[kind] * SCALE)), deadline=None,
                    database=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                          HealthCheck.too_slow])


@bounded("mlp")
@given(data=st.data())
def test_every_mutated_mlp_checkpoint_is_refused_or_loads_exactly(saved_mlp, data):
    fuzz(saved_mlp, data)


@bounded("embedding")
@given(data=st.data())
def test_every_mutated_embedding_checkpoint_is_refused_or_loads_exactly(saved_embedding, data):
    fuzz(saved_embedding, data)


@bounded("bert")
@given(data=st.data())
def test_every_mutated_bert_checkpoint_is_refused_or_loads_exactly(saved_bert, data):
    fuzz(saved_bert, data)


@pytest.mark.parametrize("kind", sorted(EXAMPLES))
def test_an_unmutated_copy_loads_exactly(kind, request):
    saved = request.getfixturevalue(f"saved_{kind}")
    with tempfile.TemporaryDirectory() as directory:
        _write(saved, directory, dict(saved.manifest))
        assert judge(saved, directory, True) == "loaded"
        assert judge(saved, directory, False) == "loaded"
