"""The checkpoint's files: names, format versions, the manifest, hashes and atomic writes."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import secrets
import struct
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from comera_compile.nn import LayoutMismatchError
from comera_compile.passes.report import OptimizeReport

MANIFEST, HF_CONFIG, HF_WEIGHTS = "comera.json", "config.json", "model.safetensors"
FORMAT_VERSION = 3
UNHASHED_VERSION = 2  # the previous format: no hashes, no layouts (loads with verify=False)
UNHASHED_FIELDS = ("format_version", "weights", "weights_bytes", "model_class", "aliases",
                   "report")
COMPILED_PREFIX = "_orig_mod."
SAVED_WEIGHTS = re.compile(r"model-[0-9a-f]{12}\.safetensors")  # as save names them
SHA256 = re.compile(r"[0-9a-f]{64}")
HASH_CHUNK = 1 << 24
STORABLE = {
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2,
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked: missing, damaged or of another model."""


class CheckpointLayoutError(CheckpointError, LayoutMismatchError):
    """A saved layer whose modes do not fit the model's already tensorized layer."""


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


def _own_file(directory: str, name: str) -> str:
    """``directory/name``, refused when it resolves (through a link) outside ``directory``:
    only the directory's own files are read."""
    path = os.path.join(directory, name)
    if os.path.dirname(os.path.realpath(path)) != os.path.realpath(directory):
        raise CheckpointError(
            f"{path} links outside {directory!r}; only the directory's own files are read: "
            "copy the file itself into it"
        )
    return path


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _header_sha256(path: str) -> str:
    """The sha256 of a safetensors file's header (its length, names, dtypes, shapes and
    offsets): cheap for any size of file, it still pins every tensor's dtype and shape."""
    with open(path, "rb") as f:
        head = f.read(8)
        size = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        return hashlib.sha256(head + f.read(min(size, 100_000_000))).hexdigest()


def _read_manifest(directory: str, verify: bool = True) -> dict[str, Any]:
    """``comera.json``, or what a ``save_pretrained`` directory implies."""
    path = _own_file(directory, MANIFEST)
    if os.path.exists(path):
        manifest = _read_json(path)
        if not isinstance(manifest, dict):
            raise CheckpointError(
                f"{path} holds a JSON {type(manifest).__name__}, not an object; save the "
                "model again"
            )
        if manifest.get("format_version") == UNHASHED_VERSION:
            return _unhashed_manifest(path, manifest, verify)
        if manifest.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(
                f"{path} has format_version {manifest.get('format_version')!r}; this version "
                f"of comera_compile reads {FORMAT_VERSION}: save the model again with it"
            )
        _check_manifest(path, manifest)
        return manifest
    if os.path.exists(_own_file(directory, HF_WEIGHTS)):
        return {"weights": HF_WEIGHTS, "aliases": {}, "report": None}
    if not os.path.isdir(directory):
        raise CheckpointError(f"no checkpoint directory {directory!r}")
    raise CheckpointError(
        f"{directory!r} holds no checkpoint: expected {MANIFEST} with its weights file (as "
        f"comera_compile.save writes) or {HF_WEIGHTS} (as save_pretrained writes)"
    )


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (ValueError, RecursionError) as exc:  # bad JSON, not UTF-8, nested too deep
        message = f"{path} is not valid JSON ({type(exc).__name__}); save the model again"
        raise CheckpointError(message) from None


def _unhashed_manifest(path: str, manifest: dict[str, Any], verify: bool) -> dict[str, Any]:
    """A manifest of the previous format, which recorded no hashes and no layouts: read only
    when the caller gives up verification (``verify=False``); shapes, dtypes, keys and
    aliases are still checked against the model."""
    if verify:
        raise CheckpointError(
            f"{path} was written by an earlier comera_compile (format_version "
            f"{UNHASHED_VERSION}), which recorded no hashes, so its bytes cannot be verified: "
            "load it with cc.load(directory, verify=False) and save it again"
        )
    legacy = {k: v for k, v in manifest.items() if k in UNHASHED_FIELDS}
    _check_manifest(path, {**legacy, "sha256": "0" * 64, "header_sha256": "0" * 64,
                           "config_sha256": None, "layouts": {}})
    return legacy


def _check_manifest(path: str, manifest: dict[str, Any]) -> None:
    """Every field ``load`` reads has the type ``save`` writes; the weights file is one of
    this directory's, named as ``save`` names it."""

    def bad(field: str, what: str) -> CheckpointError:
        value = repr(manifest.get(field))[:80]
        return CheckpointError(f"{path}: '{field}' must be {what}, got {value}; save again")

    weights = manifest.get("weights")
    if not isinstance(weights, str) or not SAVED_WEIGHTS.fullmatch(weights):
        raise bad("weights", "a file name of the form model-<12 hex digits>.safetensors")
    size = manifest.get("weights_bytes")
    if type(size) is not int or size < 0:
        raise bad("weights_bytes", "a byte count")
    for field in ("sha256", "header_sha256"):
        if not isinstance(manifest.get(field), str) or not SHA256.fullmatch(manifest[field]):
            raise bad(field, "a sha256 of 64 lowercase hex digits")
    config = manifest.get("config_sha256")
    if config is not None and (not isinstance(config, str) or not SHA256.fullmatch(config)):
        raise bad("config_sha256", f"null or a sha256 of the {HF_CONFIG} saved")
    layouts = manifest.get("layouts")
    if not isinstance(layouts, dict) or not all(
        isinstance(k, str) and isinstance(v, dict) for k, v in layouts.items()
    ):
        raise bad("layouts", "an object of layer layouts")
    aliases = manifest.get("aliases")
    if not isinstance(aliases, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()
    ):
        raise bad("aliases", "an object of tensor names")
    report = manifest.get("report")
    fields = {f.name for f in dataclasses.fields(OptimizeReport)}
    if report is not None and (not isinstance(report, dict) or not set(report) <= fields):
        raise bad("report", f"null or an object with the keys {sorted(fields)}")


def _read_weights(directory: str, manifest: dict, device: str,
                  verify: bool = True) -> dict[str, torch.Tensor]:
    path = _own_file(directory, manifest["weights"])
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
    if "sha256" in manifest:
        field, digest = ("sha256", _sha256) if verify else ("header_sha256", _header_sha256)
        if digest(path) != manifest[field]:
            what = "its bytes differ" if verify else "its header (names, dtypes, shapes) differs"
            raise CheckpointError(
                f"{path} is damaged or altered: {what} from what was saved ({field} in "
                f"{MANIFEST}); copy the file again or save the model again"
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
        if alias in state:
            raise CheckpointError(
                f"{MANIFEST} in {directory!r} ties '{alias}' to '{key}', but '{alias}' is "
                "saved itself; an alias names a tensor saved once under another name: save "
                "the model again"
            )
        if key not in state:
            raise CheckpointError(
                f"{MANIFEST} in {directory!r} ties '{alias}' to '{key}', which {path} lacks; "
                "save the model again"
            )
        state[alias] = state[key]
    return state
