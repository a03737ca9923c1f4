"""save / load: weights in safetensors, everything else in JSON; nothing runs code on load.

A checkpoint is a directory:

- ``model-<id>.safetensors``: the state dict, each tied tensor once. Every tensorized layer's
  layout (format, modes, ranks after pruning) rides in it as the layer's ``_extra_state``, a
  byte tensor of JSON, so ``model.save_pretrained`` output carries the layouts too.
- ``comera.json``: which weights file is current (with its size), aliases of tied tensors,
  the model's class and ``optimize``'s report. Replacing it is the one atomic step that
  commits a save: a crash before it leaves the previous checkpoint as it was.
- ``config.json`` for Hugging Face models, as ``save_pretrained`` writes it.

``load(dir, model=base)`` works like PEFT loading adapters onto a base model: it re-applies
the saved rewrite to the freshly built dense ``base`` and loads the weights into it, so
non-persistent buffers (rotary tables, position ids) come from the base. ``load(dir)``
builds the base from ``config.json`` for Hugging Face models.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import secrets
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from comera_compile.nn.base import decode_layout
from comera_compile.passes.report import OptimizeReport, attach_report, report_of
from comera_compile.passes.rewrite import apply_layouts

MANIFEST, HF_CONFIG, HF_WEIGHTS = "comera.json", "config.json", "model.safetensors"
FORMAT_VERSION = 2
COMPILED_PREFIX = "_orig_mod."
EXTRA = "_extra_state"
STORABLE = {
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2,
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked: missing, damaged or of another model."""


def _unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "_orig_mod", model)  # under torch.compile


def _split_ties(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors to write (each once, contiguous, unshared) and ``{alias: saved key}``."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    by_identity: dict[int, str] = {}
    storages: set[int] = set()
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"'{key}' is extra state of type {type(value).__name__}; safetensors holds "
                "tensors only, so make that module's get_extra_state return a tensor"
            )
        if value.dtype not in STORABLE:
            raise CheckpointError(
                f"'{key}' has dtype {value.dtype}, which safetensors cannot store; cast the "
                "model to a float dtype (model.float(), model.to(torch.bfloat16)) before saving"
            )
        if id(value) in by_identity:
            aliases[key] = by_identity[id(value)]
            continue
        by_identity[id(value)] = key
        tensor = value.detach().cpu().contiguous()
        ptr = tensor.untyped_storage().data_ptr()
        if tensor.numel() and ptr in storages:  # a view of another tensor: write a copy
            tensor = tensor.clone()
        storages.add(tensor.untyped_storage().data_ptr())
        tensors[key] = tensor
    return tensors, aliases


def _is_hf(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    return hasattr(config, "to_json_file") and hasattr(model, "save_pretrained")


def _replace_atomically(path: str, write) -> None:
    """``write(tmp)`` then rename over ``path``: readers see the old file or the new one."""
    tmp = f"{path}.tmp-{secrets.token_hex(4)}"
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _write_json(path: str, data: dict) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)

    _replace_atomically(path, write)


def save(model: nn.Module, directory: str | os.PathLike) -> None:
    """Write ``model`` to ``directory`` (created if needed): safetensors and JSON only.

    The save is atomic: until it finishes, ``directory`` still loads as it did before.
    """
    model = _unwrap(model)
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    tensors, aliases = _split_ties(model.state_dict(keep_vars=True))
    weights = f"model-{secrets.token_hex(6)}.safetensors"  # never overwrites a live file
    path = os.path.join(directory, weights)
    _replace_atomically(path, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    if _is_hf(model):
        config = model.config
        config.architectures = [type(model).__name__]
        _replace_atomically(os.path.join(directory, HF_CONFIG), config.to_json_file)
    report = report_of(model)
    manifest = {
        "format_version": FORMAT_VERSION,
        "weights": weights,
        "weights_bytes": os.path.getsize(path),
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "aliases": aliases,
        "report": dataclasses.asdict(report) if report is not None else None,
    }
    _write_json(os.path.join(directory, MANIFEST), manifest)  # the commit
    for old in glob.glob(os.path.join(directory, "model-*.safetensors")):
        if os.path.basename(old) != weights:
            os.remove(old)


def _read_manifest(directory: str) -> dict[str, Any]:
    """``comera.json``, or what a ``save_pretrained`` directory implies."""
    path = os.path.join(directory, MANIFEST)
    if os.path.exists(path):
        try:
            with open(path) as f:
                manifest = json.load(f)
        except json.JSONDecodeError as exc:
            message = f"{path} is not valid JSON ({exc}); save the model again"
            raise CheckpointError(message) from None
        if manifest.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(
                f"{path} has format_version {manifest.get('format_version')!r}; this version "
                f"of comera_compile reads {FORMAT_VERSION}: save the model again with it"
            )
        return manifest
    if os.path.exists(os.path.join(directory, HF_WEIGHTS)):
        return {"weights": HF_WEIGHTS, "aliases": {}, "report": None}
    if not os.path.isdir(directory):
        raise CheckpointError(f"no checkpoint directory {directory!r}")
    raise CheckpointError(
        f"{directory!r} holds no checkpoint: expected {MANIFEST} with its weights file (as "
        f"comera_compile.save writes) or {HF_WEIGHTS} (as save_pretrained writes)"
    )


def _read_weights(directory: str, manifest: dict, device: str) -> dict[str, torch.Tensor]:
    path = os.path.join(directory, manifest["weights"])
    if not os.path.exists(path):
        raise CheckpointError(
            f"checkpoint {directory!r} is missing {manifest['weights']} (named by {MANIFEST}); "
            "the file was removed or copied without it: copy the whole directory or save again"
        )
    size, expected = os.path.getsize(path), manifest.get("weights_bytes")
    if expected is not None and size != expected:
        raise CheckpointError(
            f"{path} is truncated or altered: {size:,} bytes where {expected:,} were saved; "
            "copy the file again or save the model again"
        )
    try:
        state = load_file(path, device=device)
    except SafetensorError as exc:
        raise CheckpointError(
            f"{path} is not a readable safetensors file ({exc}); it may be truncated: copy it "
            "again or save the model again"
        ) from None
    state = {k.removeprefix(COMPILED_PREFIX): v for k, v in state.items()}
    for alias, key in manifest["aliases"].items():
        state[alias] = state[key]
    return state


def _build_hf_base(directory: str, manifest: dict) -> nn.Module:
    """The dense model ``config.json`` describes, as ``from_config`` builds it."""
    if not os.path.exists(os.path.join(directory, HF_CONFIG)):
        saved = manifest.get("model_class", "the saved model")
        raise CheckpointError(
            f"{directory!r} has no {HF_CONFIG}, so the model cannot be rebuilt from it: build "
            f"the dense model ({saved}) and pass it: comera_compile.load(dir, model=base)"
        )
    import transformers

    config = transformers.AutoConfig.from_pretrained(directory)
    names = getattr(config, "architectures", None) or []
    cls = getattr(transformers, names[0], None) if names else None
    if cls is None:
        raise CheckpointError(
            f"{HF_CONFIG} in {directory!r} names no transformers model class "
            f"(architectures={names}); build the model and pass it as model="
        )
    return cls(config)


def _hf_names(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keys of a ``save_pretrained`` file under the model's own names: transformers 5 saves
    some models (ViT, ...) under their legacy names and renames them on load."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:  # an older transformers saves under the model's own names
        return state
    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    if not renamings:
        return state
    return {rename_source_key(k, renamings, [])[0]: v for k, v in state.items()}


def _layouts(state: dict[str, torch.Tensor]) -> dict[str, dict]:
    """``{layer name: layout}`` from the tensorized layers' extra state in ``state``."""
    found = {}
    for key, value in state.items():
        if key == EXTRA or key.endswith("." + EXTRA):
            layout = decode_layout(value)
            if "format" in layout:
                found[key.removesuffix(EXTRA).removesuffix(".")] = layout
    return found


def _fill_ties(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Add the keys of tensors the model ties to a saved one (``save_pretrained`` writes a
    tied tensor under one name only)."""
    groups: dict[int, list[str]] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(value), []).append(key)
    for keys in groups.values():
        saved = next((k for k in keys if k in state), None)
        if saved is not None:
            for key in keys:
                state.setdefault(key, state[saved])


def _check_keys(model: nn.Module, state: dict[str, torch.Tensor], manifest: dict) -> None:
    expected = set(model.state_dict().keys())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if not (missing or unexpected):
        return
    saved = manifest.get("model_class", "another model")

    def few(keys: list[str]) -> str:
        return ", ".join(keys[:3]) + (", ..." if len(keys) > 3 else "")

    parts = []
    if missing:
        parts.append(f"{len(missing)} of the model's tensors are not in it ({few(missing)})")
    if unexpected:
        parts.append(f"{len(unexpected)} of its tensors have no place here ({few(unexpected)})")
    raise CheckpointError(
        f"the checkpoint (of {saved}) does not fit {type(model).__name__}: "
        f"{'; '.join(parts)}; pass a model built with the configuration that was saved"
    )


def load(
    directory: str | os.PathLike,
    model: nn.Module | None = None,
    map_location: str | torch.device = "cpu",
) -> nn.Module:
    """Load a checkpoint written by ``save`` (or by ``save_pretrained`` on an optimized model).

    With ``model`` (a freshly built dense model, the way PEFT loads adapters onto a base, or
    an already optimized one): re-applies the saved rewrite to it in place and loads every
    weight exactly; returns ``model``. Without: rebuilds a Hugging Face model from the saved
    ``config.json``. A checkpoint of another model raises ``CheckpointError`` naming the
    tensors that differ; a layer of other modes raises ``LayoutMismatchError``.
    """
    directory = os.fspath(directory)
    manifest = _read_manifest(directory)
    state = _read_weights(directory, manifest, str(map_location))
    returned = _build_hf_base(directory, manifest) if model is None else model
    target = _unwrap(returned)
    if manifest["weights"] == HF_WEIGHTS and _is_hf(target):
        state = _hf_names(target, state)
    apply_layouts(target, _layouts(state))
    _fill_ties(target, state)
    _check_keys(target, state, manifest)
    try:
        target.load_state_dict(state, strict=True)
    except RuntimeError as exc:  # shapes that differ
        raise CheckpointError(
            f"the checkpoint does not fit {type(target).__name__}: {exc}; pass a model built "
            "with the configuration that was saved"
        ) from None
    if manifest.get("report"):
        attach_report(target, OptimizeReport(**manifest["report"]))
    return returned
