"""Drop-in end to end on models this project did not write (Hugging Face models built from
tiny configs, torch's TransformerEncoder, a DLRM-style model): budget met, eval
deterministic, optimize -> 3 training steps -> save -> load onto a fresh base and (Hugging
Face) from config.json alone -> identical outputs; checkpoints hold no pickle; bad
checkpoints fail with errors that name the fix."""

import os

import pytest
import torch
import torch.nn.functional as F
from hf_models import HF_MODELS
from models import dlrm_batch, small_dlrm
from safetensors.torch import load_file
from torch import nn

import comera_compile as cc
from comera_compile.io import CheckpointError
from comera_compile.nn import TensorizedLayer

BUDGETS = {"bert": 0.05, "roberta": 0.05, "gpt2": 0.05, "llama": 0.05, "qwen2": 0.1,
           "t5": 0.05, "vit": 0.2}


def n_params(model):
    return sum(p.numel() for p in model.parameters())


def _encoder():
    def build():
        layer = nn.TransformerEncoderLayer(64, 4, 256, dropout=0.1, batch_first=True)
        return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    x = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(0))
    return build, (x,), lambda out: out.square().mean()


def _dlrm():
    def build():
        return small_dlrm((5000, 300), dim=16)

    torch.manual_seed(0)
    inputs = dlrm_batch(build())
    return build, inputs, lambda out: F.binary_cross_entropy_with_logits(out, torch.ones(8))


def _call(model, inputs):
    out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    return getattr(out, "logits", out)


def _train(model, inputs, loss_fn, steps=3):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        loss = loss_fn(_call(model, inputs))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


def _assert_no_pickle(directory):
    for name in os.listdir(directory):
        assert name.endswith((".json", ".safetensors")), name
        with open(os.path.join(directory, name), "rb") as f:
            head = f.read(9)
        # safetensors: an 8-byte header length, then the JSON header; JSON: an object
        first = head[8:9] if name.endswith(".safetensors") else head[:1]
        assert first == b"{", f"{name} is not safetensors or JSON (it starts {head!r})"


def _round_trip(build, inputs, loss_fn, budget, tmp_path, hf):
    torch.manual_seed(0)
    base = build()
    model = cc.optimize(base, budget, compile=False)
    assert n_params(model) <= budget * n_params(base)
    assert type(model) is type(base)
    with torch.no_grad():
        untrained = _call(model.eval(), inputs)
    _train(model, inputs, loss_fn)
    with torch.no_grad():
        expected = _call(model, inputs)
    # training moved the outputs, so only the trained weights can reproduce them below
    assert not torch.allclose(expected, untrained, rtol=1e-3, atol=1e-5)
    cc.save(model, tmp_path)
    _assert_no_pickle(tmp_path)
    torch.manual_seed(1)  # the base gets other random weights: all must come from the file
    loaded = [cc.load(tmp_path, model=build()).eval()]
    if hf:
        loaded.append(cc.load(tmp_path).eval())
    else:  # into a model that is already optimized (other ranks after random init)
        loaded.append(cc.load(tmp_path, model=cc.optimize(build(), budget, compile=False)))
    for other in loaded:
        with torch.no_grad():
            assert torch.equal(_call(other.eval(), inputs), expected)
        assert str(cc.summary(other)) == str(cc.summary(model))
    return model, expected


@pytest.mark.parametrize("name", ["llama", "encoder", "dlrm"])
def test_round_trip(name, tmp_path):
    if name in HF_MODELS:
        _round_trip(*HF_MODELS[name](), BUDGETS[name], tmp_path, hf=True)
    else:
        _round_trip(*{"encoder": _encoder, "dlrm": _dlrm}[name](), 0.1, tmp_path, hf=False)


@pytest.mark.slow  # about 5-10 s per model on 2 cores
@pytest.mark.parametrize("name", [n for n in HF_MODELS if n != "llama"])
def test_round_trip_hugging_face(name, tmp_path):
    build, inputs, loss_fn = HF_MODELS[name]()
    model, expected = _round_trip(build, inputs, loss_fn, BUDGETS[name], tmp_path / "cc", True)
    model.save_pretrained(tmp_path / "hf")
    with torch.no_grad():
        assert torch.equal(_call(cc.load(tmp_path / "hf").eval(), inputs), expected)


def test_bfloat16_model_loads_back_in_bfloat16_with_the_same_outputs(tmp_path):
    """A model rebuilt from its config is float32: the weights keep their dtype, so the
    loaded model computes what the saved one did (it computed in float32 before, and its
    logits differed by up to 0.0045)."""
    from hf_models import bert

    build, inputs, _ = bert()
    torch.manual_seed(0)
    model = cc.optimize(build().to(torch.bfloat16), 0.5, compile=False).eval()
    with torch.no_grad():
        expected = _call(model, inputs)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}  # rank gates stay float32
    assert torch.bfloat16 in dtypes.values()
    cc.save(model, tmp_path)
    for loaded in (cc.load(tmp_path), cc.load(tmp_path, model=build())):
        loaded.eval()
        assert {n: p.dtype for n, p in loaded.named_parameters()} == dtypes
        with torch.no_grad():
            assert torch.equal(_call(loaded, inputs), expected)


def _saved_mlp(tmp_path):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    cc.save(cc.optimize(base, 0.5, compile=False), tmp_path)
    return base


def test_load_into_other_architecture_names_what_differs(tmp_path):
    _saved_mlp(tmp_path)
    other = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 32))
    with pytest.raises(ValueError, match=r"tensorized '2' as a linear \(256, 64\).*linear "
                       r"\(256, 32\).*built with the configuration"):
        cc.load(tmp_path, model=other)
    deeper = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64), nn.Linear(64, 8))
    with pytest.raises(CheckpointError, match=r"does not fit Sequential: 2 of the model's "
                       r"tensors are not in it \(3.bias, 3.weight\)"):
        cc.load(tmp_path, model=deeper)


def test_missing_and_truncated_files(tmp_path):
    base = _saved_mlp(tmp_path)
    weights = next(n for n in os.listdir(tmp_path) if n.endswith(".safetensors"))
    data = (tmp_path / weights).read_bytes()
    (tmp_path / weights).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"truncated or altered: .* bytes where"):
        cc.load(tmp_path, model=base)
    (tmp_path / weights).unlink()
    with pytest.raises(CheckpointError, match=f"missing {weights}.*copy the whole directory"):
        cc.load(tmp_path, model=base)
    with pytest.raises(CheckpointError, match="no checkpoint directory"):
        cc.load(tmp_path / "nothing-here", model=base)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds no checkpoint: expected comera.json"):
        cc.load(tmp_path / "empty", model=base)
    with pytest.raises(CheckpointError, match=r"no config.json.*load\(dir, model=base\)"):
        _saved_mlp(tmp_path / "again")
        cc.load(tmp_path / "again")


def test_truncated_file_without_size_record(tmp_path):
    """A save_pretrained directory has no size record: safetensors' own check names it."""
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    with pytest.raises(CheckpointError, match="not a readable safetensors file.*truncated"):
        cc.load(tmp_path, model=nn.Linear(2, 2))


def test_unsupported_dtype_names_the_cast(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4))
    model.register_buffer("phase", torch.zeros(3, dtype=torch.complex64))
    with pytest.raises(CheckpointError, match=r"'phase' has dtype torch.complex64.*model.float"):
        cc.save(model, tmp_path)
    int_model = nn.Sequential(nn.Embedding(4096, 64))
    int_model[0].weight = nn.Parameter(torch.ones(4096, 64, dtype=torch.int8), False)
    with pytest.raises(TypeError, match=r"'0' has torch.int8 weights.*floating"):
        cc.optimize(int_model, compile=False)


def test_save_is_atomic_a_failed_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    base = _saved_mlp(tmp_path)
    before = sorted(os.listdir(tmp_path))
    model = cc.load(tmp_path, model=base)
    x = torch.randn(3, 64)
    with torch.no_grad():
        expected = model(x)
        next(p for p in model.parameters()).add_(1.0)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("comera_compile.io._write_json", crash)  # dies before the commit
    with pytest.raises(OSError):
        cc.save(model, tmp_path)
    monkeypatch.undo()
    torch.manual_seed(3)
    fresh = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    with torch.no_grad():
        assert torch.equal(cc.load(tmp_path, model=fresh)(x), expected)
    cc.save(model, tmp_path)  # a later save cleans up the stray file
    assert len(os.listdir(tmp_path)) == len(before)


def test_compiled_models_are_unwrapped_on_both_sides(tmp_path):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    model = cc.optimize(base, 0.5)  # compile=True: a torch.compile wrapper
    cc.save(model, tmp_path)
    keys = load_file(next(str(p) for p in tmp_path.iterdir() if p.suffix == ".safetensors"))
    assert not any(k.startswith("_orig_mod.") for k in keys)
    target = torch.compile(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)))
    loaded = cc.load(tmp_path, model=target)
    assert loaded is target and isinstance(target._orig_mod[0], TensorizedLayer)


def test_tables_saved_in_chain_order_load_back_with_the_same_outputs(tmp_path):
    """A checkpoint from before TT tables stored their cores slices first (chain-order
    cores, layouts without "cores") loads, by ``cc.load`` and ``load_state_dict``."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    from comera_compile.io import format as io_format
    from comera_compile.nn.base import decode_layout, encode_layout

    build, inputs, loss_fn = _dlrm()
    model = _train(cc.optimize(build(), 0.3, compile=False), inputs, loss_fn)
    expected = _call(model, inputs)
    cc.save(model, tmp_path)
    manifest = json.loads((tmp_path / io_format.MANIFEST).read_text())
    path = tmp_path / manifest["weights"]
    with safe_open(path, "pt") as f:
        metadata = f.metadata()
    state, turned = load_file(path), 0
    for key in [k for k in state if k.endswith("._extra_state")]:
        layout = decode_layout(state[key])
        if layout.get("format") != "tt_embedding":
            continue
        assert layout.pop("cores") == "slices_first"
        manifest["layouts"][key[: -len("._extra_state")]].pop("cores")
        state[key] = encode_layout(layout)
        for k in range(len(layout["ranks"]) - 1):
            core = state[f"{key[: -len('_extra_state')]}cores.{k}"]
            state[f"{key[: -len('_extra_state')]}cores.{k}"] = core.transpose(0, 1).contiguous()
            turned += min(core.shape[:2]) > 1  # a transpose that moves values
    assert turned >= 2
    save_file(state, path, metadata=metadata)
    manifest.update(weights_bytes=os.path.getsize(path), sha256=io_format._sha256(path),
                    header_sha256=io_format._header_sha256(path))
    (tmp_path / io_format.MANIFEST).write_text(json.dumps(manifest))
    assert torch.equal(_call(cc.load(tmp_path, model=build()).eval(), inputs), expected)
    fresh = cc.optimize(build(), 0.3, compile=False)
    fresh.load_state_dict(state)
    assert torch.equal(_call(fresh.eval(), inputs), expected)
