"""save / load: weights in safetensors, everything else in JSON; nothing runs code on load.

A checkpoint is a directory:

- ``model-<id>.safetensors``: the state dict, each tied tensor once. Every tensorized layer's
  layout (format, modes, ranks after pruning) rides in it as the layer's ``_extra_state``, a
  byte tensor of JSON, so ``model.save_pretrained`` output carries the layouts too.
- ``comera.json``: which weights file is current (with its size, its sha256 and that of its
  header), the sha256 of ``config.json``, every layer's layout again, aliases of tied
  tensors, the model's class and ``optimize``'s report. Replacing it is the one atomic step
  that commits a save: a crash before it leaves the previous checkpoint as it was.
- ``config.json`` for Hugging Face models, as ``save_pretrained`` writes it.

Loading trusts nothing in the directory: a damaged or crafted checkpoint raises
``CheckpointError`` naming the problem. Only the directory's own files are read (nothing a
link leads outside), the weights file only by the saved name pattern and only once its
sha256 matches (``verify=False`` checks the header's alone, for files too big to hash);
each layout must be the one the manifest recorded, each tensor of the dtype its module
holds; aliases may only join tensors the model itself ties; a report that does not
describe the model is dropped with a warning. Only ``transformers`` model classes are built,
from their own configuration class (never ``AutoConfig``, which may import or prompt for a
checkpoint's code), and a ``config.json`` whose sizes disagree with the weights is refused
before anything is built.

``load(dir, model=base)`` works like PEFT loading adapters onto a base model: it re-applies
the saved rewrite to the freshly built dense ``base`` and loads the weights into it, so
non-persistent buffers (rotary tables, position ids) come from the base. ``load(dir)``
builds the base from ``config.json`` for Hugging Face models.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import re
import secrets
import struct
import warnings
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from comera_compile.config import config_of
from comera_compile.formats import TT_EMBEDDING
from comera_compile.nn import (
    LayoutMismatchError,
    SplitMultiheadAttention,
    TensorizedLayer,
    TiedEmbeddingHead,
    TTEmbedding,
)
from comera_compile.nn.attention import SPLIT_ATTENTION
from comera_compile.nn.base import decode_layout, gate_dtype
from comera_compile.nn.tied_head import TIED_HEAD
from comera_compile.passes.report import OptimizeReport, attach_report, report_of, summary
from comera_compile.passes.rewrite import LINEAR_CLASSES, apply_layouts

MANIFEST, HF_CONFIG, HF_WEIGHTS = "comera.json", "config.json", "model.safetensors"
FORMAT_VERSION = 3
UNHASHED_VERSION = 2  # the previous format: no hashes, no layouts (loads with verify=False)
UNHASHED_FIELDS = ("format_version", "weights", "weights_bytes", "model_class", "aliases",
                   "report")
COMPILED_PREFIX = "_orig_mod."
EXTRA = "_extra_state"
SAVED_WEIGHTS = re.compile(r"model-[0-9a-f]{12}\.safetensors")  # as save names them
OUR_LAYERS = (TensorizedLayer, SplitMultiheadAttention, TiedEmbeddingHead)
TENSORIZED_FORMATS = {*LINEAR_CLASSES, TT_EMBEDDING}
KNOWN_FORMATS = {*TENSORIZED_FORMATS, SPLIT_ATTENTION, TIED_HEAD}
LIST_FIELDS = ("ranks", "in_modes", "out_modes", "row_modes", "col_modes")
INT_FIELDS = ("in_features", "out_features", "num_embeddings", "embedding_dim")
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
        "sha256": _sha256(path),
        "header_sha256": _header_sha256(path),
        "config_sha256": _sha256(os.path.join(directory, HF_CONFIG)) if _is_hf(model) else None,
        "layouts": _saved_layouts(tensors, model),
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "aliases": aliases,
        "report": dataclasses.asdict(report) if report is not None else None,
    }
    _write_json(os.path.join(directory, MANIFEST), manifest)  # the commit
    for old in glob.glob(os.path.join(directory, "model-*.safetensors")):
        if os.path.basename(old) != weights:
            os.remove(old)


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


def _saved_layouts(tensors: dict[str, torch.Tensor], model: nn.Module) -> dict[str, dict]:
    """``{layer name: layout}`` of the layers whose layouts ride in ``tensors``, as
    ``_layouts`` reads them back: the manifest keeps them so a layout altered in the
    weights file is caught even where the file is not hashed."""
    found = {}
    for key, value in tensors.items():
        if key == EXTRA or key.endswith("." + EXTRA):
            name = key.removesuffix(EXTRA).removesuffix(".").removeprefix(COMPILED_PREFIX)
            if _is_ours(model, name):
                found[name] = decode_layout(value)
    return found


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


def _build_hf_base(directory: str, manifest: dict, state: dict[str, torch.Tensor]) -> nn.Module:
    """The dense model ``config.json`` describes, as ``from_config`` builds it: only a
    ``transformers`` model class, and only once its sizes agree with the weights."""
    if not os.path.exists(os.path.join(directory, HF_CONFIG)):
        saved = manifest.get("model_class", "the saved model")
        raise CheckpointError(
            f"{directory!r} has no {HF_CONFIG}, so the model cannot be rebuilt from it: build "
            f"the dense model ({saved}) and pass it: comera_compile.load(dir, model=base)"
        )
    import transformers

    def refuse(problem: str) -> CheckpointError:
        return CheckpointError(
            f"{HF_CONFIG} in {directory!r} {problem}; build the model and pass it as model="
        )

    path = _own_file(directory, HF_CONFIG)
    data = _read_json(path)  # bad JSON is named as ours
    if not isinstance(data, dict):
        raise refuse(f"holds a JSON {type(data).__name__}, not an object")
    remote = _remote_code_field(data)
    if remote is not None:
        raise refuse(f"asks for code of its own ('{remote}'); loading never runs code")
    if "sha256" in manifest and _sha256(path) != manifest.get("config_sha256"):
        raise CheckpointError(  # it sets what the weights compute (eps, activations, ...)
            f"{HF_CONFIG} in {directory!r} is not the one saved with the weights (its sha256 "
            f"differs from config_sha256 in {MANIFEST}); copy it again or save the model again"
        )
    model_type = data.get("model_type")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise refuse(f"names no model_type transformers knows ({str(model_type)[:40]!r})")
    try:  # the configuration class itself: AutoConfig may import code or prompt for it
        config = CONFIG_MAPPING[model_type].from_dict(data)
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds on bad configs
        raise refuse(f"is not a configuration transformers reads ({type(exc).__name__})") from None
    names = getattr(config, "architectures", None) or []
    name = names[0] if isinstance(names, list) and names else None
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise refuse(f"names no transformers model class (architectures={names!r:.80})")
    config_class = getattr(cls, "config_class", None)  # None: an abstract base class
    if not (isinstance(config_class, type) and isinstance(config, config_class)):
        raise refuse(f"names {name}, which is not a model class of its {type(config).__name__}")
    try:
        with torch.device("meta"):  # sizes only: nothing is allocated
            meta = cls(config)
        _check_config_sizes(meta, state, manifest)
        return cls(config)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - a model's __init__ may reject a config any way
        raise refuse(f"cannot build {name} ({type(exc).__name__}: {str(exc)[:200]})") from None


REMOTE_CODE_FIELDS = ("auto_map", "custom_pipelines", "trust_remote_code")


def _remote_code_field(data: Any, depth: int = 0) -> str | None:
    """The first field, at any depth, by which a configuration asks transformers to import
    a file of the checkpoint's."""
    if depth > 16:
        return None  # deeper than any configuration; from_dict refuses it or ignores it
    if isinstance(data, dict):
        for key, value in data.items():
            if key in REMOTE_CODE_FIELDS:
                return key
            found = _remote_code_field(value, depth + 1)
            if found is not None:
                return found
    elif isinstance(data, list):
        return next((f for v in data if (f := _remote_code_field(v, depth + 1))), None)
    return None


def _check_config_sizes(meta: nn.Module, state: dict[str, torch.Tensor], manifest: dict) -> None:
    """The sizes the configuration gives (a model built on the meta device) against the
    saved tensors and layouts, before a real model is allocated."""
    if manifest["weights"] == HF_WEIGHTS:
        state = _hf_names(meta, state)
    layouts = _layouts(state, meta)
    inside = tuple(f"{name}." for name in layouts)
    dense = meta.state_dict()
    for key, tensor in state.items():
        if key in dense and not key.startswith(inside) and dense[key].shape != tensor.shape:
            raise CheckpointError(
                f"{HF_CONFIG} gives '{key}' the shape {tuple(dense[key].shape)} but the weights "
                f"hold {tuple(tensor.shape)}; the configuration is not the saved model's"
            )
    for name, layout in layouts.items():
        try:
            module = meta.get_submodule(name)
        except AttributeError:
            continue  # named by _check_keys or apply_layouts with the fix
        for attr in ("in_features", "out_features", "num_embeddings", "embedding_dim"):
            if attr in layout and getattr(module, attr, layout[attr]) != layout[attr]:
                raise CheckpointError(
                    f"{HF_CONFIG} gives '{name}' {attr}={getattr(module, attr)} but the "
                    f"weights were saved with {layout[attr]}; the configuration is not the "
                    "saved model's"
                )


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


def _is_ours(model: nn.Module, name: str) -> bool:
    """Whether ``name``'s extra state is a layout: a module of the model's own that keeps
    extra state of its own is not one of our layers."""
    try:
        module = model.get_submodule(name)
    except AttributeError:
        return True  # no such module: the layout names it, apply_layouts refuses it
    if isinstance(module, OUR_LAYERS):
        return True
    return type(module).get_extra_state is nn.Module.get_extra_state


def _layouts(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, dict]:
    """``{layer name: layout}`` from our layers' extra state in ``state``, each checked
    against the saved tensors (so a crafted rank cannot make a layer allocate more)."""
    found = {}
    for key, value in state.items():
        if not (key == EXTRA or key.endswith("." + EXTRA)):
            continue
        name = key.removesuffix(EXTRA).removesuffix(".")
        if not _is_ours(model, name):
            continue
        try:
            layout = decode_layout(value)
        except (ValueError, RecursionError, TypeError, OverflowError):
            layout = None  # not UTF-8, not JSON, nested too deep
        if not isinstance(layout, dict) or not isinstance(layout.get("format"), str):
            raise CheckpointError(
                f"the layout of layer '{name}' in the checkpoint is not readable (a JSON object "
                "with a 'format'); save the model again"
            )
        found[name] = layout
    for name, layout in found.items():
        _check_layout(_holder(name, layout, found, state), layout, state)
    return found


def _holder(name: str, layout: dict[str, Any], layouts: dict[str, dict], state) -> str:
    """The name the layer's tensors were saved under: its own, or that of the layer it
    shares (``save_pretrained`` writes a tied table once)."""
    if f"{name}.cores.0" in state:
        return name
    shared = (o for o, same in layouts.items() if same == layout and f"{o}.cores.0" in state)
    return next(shared, name)


def _check_layout(name: str, layout: dict[str, Any], state: dict[str, torch.Tensor]) -> None:
    """Sizes and ranks are positive ints, the ranks those of the saved gates."""

    def bad(what: str) -> CheckpointError:
        return CheckpointError(
            f"the layout of layer '{name}' in the checkpoint {what}; save the model again"
        )

    for field, value in layout.items():
        if field in LIST_FIELDS:
            if not isinstance(value, list) or not value:
                raise bad(f"has '{field}' = {str(value)[:80]}, not a list of positive integers")
            values = value
        elif field in INT_FIELDS:
            values = [value]
        else:
            continue
        if not all(type(v) is int and v > 0 for v in values):
            raise bad(f"has '{field}' = {str(value)[:80]}, not positive integers")
    if layout["format"] not in KNOWN_FORMATS:
        raise bad(f"has an unknown format {layout['format'][:40]!r}")
    threshold = layout.get("threshold", 0.0)
    if type(threshold) not in (int, float):
        raise bad(f"has a threshold {str(threshold)[:80]}, not a number")
    ranks = layout.get("ranks")
    if ranks is None:
        if layout["format"] in TENSORIZED_FORMATS:
            raise bad("lacks 'ranks'")
        return
    gates = [state.get(f"{name}.gates.{k}") for k in range(len(ranks) - 2)]
    saved = [None if g is None else g.numel() for g in gates]
    if len(ranks) < 2 or ranks[0] != 1 or ranks[-1] != 1 or saved != ranks[1:-1]:
        raise bad(f"has ranks {str(ranks)[:80]} where its saved gates have sizes {saved}")
    try:
        with torch.device("meta"):  # the cores the layout implies, allocating nothing
            cores = [tuple(c.shape) for c in _layer_of(layout).cores]
    except (KeyError, TypeError, ValueError) as exc:
        raise bad(f"does not describe a layer ({type(exc).__name__}: {str(exc)[:120]})") from None
    saved_cores = [tuple(state[f"{name}.cores.{k}"].shape) if f"{name}.cores.{k}" in state
                   else None for k in range(len(cores))]
    if cores != saved_cores:
        raise bad(f"implies cores {cores} where the weights hold {saved_cores}")


def _layer_of(layout: dict[str, Any]) -> TensorizedLayer:
    """The layer a layout describes, as ``layer_from_layout`` builds it (sizes only)."""
    ranks = layout["ranks"][1:-1]
    if layout["format"] == TT_EMBEDDING:
        return TTEmbedding(
            layout["num_embeddings"], layout["embedding_dim"], ranks=ranks,
            row_modes=layout["row_modes"], col_modes=layout["col_modes"],
            cache_rows=layout.get("cache_rows", 0),
        )
    cls = LINEAR_CLASSES[layout["format"]]
    return cls(layout["in_features"], layout["out_features"], ranks=ranks,
               in_modes=layout["in_modes"], out_modes=layout["out_modes"], bias=False)


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


def _take_saved_dtypes(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Floating parameters and buffers take the dtype they were saved in: a model rebuilt
    from its config is float32, and copying bfloat16 weights into it would keep their values
    but compute in float32, so its outputs would not be the saved model's."""
    named = [*model.named_parameters(remove_duplicate=False),
             *model.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        saved = state.get(name)
        if (isinstance(saved, torch.Tensor) and saved.is_floating_point()
                and tensor.is_floating_point() and saved.dtype != tensor.dtype):
            tensor.data = tensor.data.to(saved.dtype)


def _apply_layouts(model: nn.Module, layouts: dict[str, dict]) -> None:
    """``apply_layouts``, its refusals raised as ``CheckpointError``."""
    try:
        apply_layouts(model, layouts)
    except LayoutMismatchError as exc:
        raise CheckpointLayoutError(str(exc)) from None
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    except (KeyError, TypeError, IndexError, ZeroDivisionError) as exc:  # a field missing
        raise CheckpointError(
            f"a layer layout in the checkpoint is damaged ({type(exc).__name__}: "
            f"{str(exc)[:120]}); save the model again"
        ) from None


def _check_saved_layouts(found: dict[str, dict], manifest: dict) -> None:
    """The layouts in the weights file are those the manifest recorded at save: a layer's
    format, modes or threshold changed in the file would load other outputs silently
    (CoLA, low rank and a TT of one mode per side have cores of the same shapes)."""
    recorded = manifest.get("layouts")
    if recorded is None:
        return  # save_pretrained output: the weights file is all there is
    for name in sorted(set(found) | set(recorded)):
        if found.get(name) != recorded.get(name):
            raise CheckpointError(
                f"the layout of layer '{name}' in the weights file ({str(found.get(name))[:120]}) "
                f"is not the one {MANIFEST} recorded at save ({str(recorded.get(name))[:120]}); "
                "the files are of different saves or altered: save the model again"
            )


def _check_aliases(model: nn.Module, manifest: dict) -> None:
    """An alias may only join two names the model itself ties (one tensor under both)."""
    tensors = model.state_dict(keep_vars=True)
    for alias, key in manifest["aliases"].items():
        if alias in tensors and key in tensors and tensors[alias] is not tensors[key]:
            raise CheckpointError(
                f"{MANIFEST} ties '{alias}' to '{key}', which {type(model).__name__} does not "
                "tie: loading would give one tensor's values to both; save the model again"
            )


def _check_dtypes(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Each saved tensor has a dtype its module can compute with: the kind the model holds
    there (floating or not, an integer exactly), one floating dtype for all of a module's
    own tensors, rank gates in the dtype ``gate_dtype`` gives their cores, and a floating
    dtype other than the model's own only where the whole checkpoint is of that dtype (a
    model cast as a whole, ``model.to(torch.bfloat16)``)."""

    def refuse(key: str, saved: torch.dtype, why: str) -> CheckpointError:
        return CheckpointError(
            f"'{key}' is saved as {saved}, but {why}; the weights file is altered: save the "
            "model again"
        )

    lists = (nn.ParameterList, nn.ParameterDict)
    cast: dict[str, tuple[torch.dtype, torch.dtype]] = {}  # key -> (saved, the model's)
    for prefix, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, lists):
            continue  # its parent's tensors (a layer's cores and gates)
        dot = f"{prefix}." if prefix else ""
        own = {**dict(module.named_parameters(recurse=False)),
               **dict(module.named_buffers(recurse=False))}
        for child_name, child in module.named_children():
            if isinstance(child, lists):
                own.update({f"{child_name}.{n}": p
                            for n, p in child.named_parameters(recurse=False)})
        floating: dict[torch.dtype, str] = {}
        gates = []
        for name, tensor in own.items():
            key = dot + name
            saved = state.get(key)
            if not isinstance(saved, torch.Tensor) or tensor is None:
                continue  # not saved (non-persistent): _check_keys names a missing one
            if saved.is_floating_point() != tensor.is_floating_point() or (
                    not saved.is_floating_point() and saved.dtype != tensor.dtype):
                raise refuse(key, saved.dtype, f"the model holds {tensor.dtype} there")
            if saved.dtype.itemsize == 1 and saved.dtype != tensor.dtype:  # float8
                raise refuse(key, saved.dtype, f"the model holds {tensor.dtype} there")
            if saved.is_floating_point() and isinstance(module, TensorizedLayer) and (
                    name.startswith("gates.")):
                gates.append((key, saved.dtype))
            elif saved.is_floating_point():
                floating.setdefault(saved.dtype, key)
                cast[key] = (saved.dtype, tensor.dtype)
        if len(floating) > 1:
            (a, key_a), (b, key_b) = list(floating.items())[:2]
            raise refuse(key_b, b, f"'{key_a}' of the same module is saved as {a}")
        for key, dtype in gates:
            want = gate_dtype(next(iter(floating), dtype))
            if dtype != want:
                raise refuse(key, dtype, f"a rank gate of this layer's cores is {want}")
    dtypes = {saved for saved, _ in cast.values()}
    if len(dtypes) > 1:
        for key, (saved, own) in cast.items():
            if saved != own:
                raise refuse(key, saved, f"the model holds {own} there and the checkpoint "
                             f"mixes {', '.join(sorted(str(d) for d in dtypes))}")


REPORT_TYPES = {
    "capture_path": str, "capture_reason": str, "budget": (str, type(None)),
    "rank": (int, type(None)), "init": str, "before": dict, "originals": dict,
    "skipped": dict, "returned": str, "config": (dict, type(None)),
}


def _check_report(data: dict[str, Any], model: nn.Module) -> OptimizeReport:
    """The saved report as ``summary`` and ``config_of`` read it, or ValueError/TypeError
    (any exception) naming what does not fit."""
    for field, kind in REPORT_TYPES.items():
        if field in data and not isinstance(data[field], kind):
            raise TypeError(f"'{field}' is a {type(data[field]).__name__}")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in data["skipped"].items()):
        raise TypeError("'skipped' is not an object of reasons")
    if not all(isinstance(v, dict) for v in data.get("originals", {}).values()):
        raise TypeError("'originals' is not an object of layer records")
    report = OptimizeReport(**data)  # a missing capture_path / capture_reason: TypeError
    if report.config is not None:
        from comera_compile.config import CompressionConfig

        CompressionConfig.from_dict(report.config)
    before = report_of(model)
    attach_report(model, report)
    try:
        str(summary(model))  # every field summary reads, of the types it formats
    finally:
        attach_report(model, before)
    return report


def _loaded_report(manifest: dict, model: nn.Module) -> OptimizeReport | None:
    data = manifest.get("report")
    if not data:
        return None
    try:
        return _check_report({"skipped": {}, **data}, model)
    except Exception as exc:  # noqa: BLE001 - a report is a record: any fault drops it
        warnings.warn(
            f"the report in {MANIFEST} does not describe the loaded model "
            f"({type(exc).__name__}: {str(exc)[:120]}); it was dropped, so summary shows "
            "the live layers only",
            stacklevel=3,
        )
        return None


def load(
    directory: str | os.PathLike,
    model: nn.Module | None = None,
    map_location: str | torch.device = "cpu",
    verify: bool = True,
) -> nn.Module:
    """Load a checkpoint written by ``save`` (or by ``save_pretrained`` on an optimized model).

    With ``model`` (a freshly built dense model, the way PEFT loads adapters onto a base, or
    an already optimized one): re-applies the saved rewrite to it in place and loads every
    weight exactly; returns ``model``. Without: rebuilds a Hugging Face model from the saved
    ``config.json``. A checkpoint of another model raises ``CheckpointError`` naming the
    tensors that differ; a layer of other modes raises ``CheckpointLayoutError`` (both a
    ``CheckpointError`` and a ``LayoutMismatchError``). ``verify=False`` skips hashing the
    whole weights file (for files too big to read twice): its header is still checked,
    but altered tensor values would then load unnoticed; it also reads checkpoints of the
    previous format, which recorded no hashes.
    """
    directory = os.fspath(directory)
    manifest = _read_manifest(directory, verify)
    state = _read_weights(directory, manifest, str(map_location), verify)
    returned = _build_hf_base(directory, manifest, state) if model is None else model
    target = _unwrap(returned)
    if manifest["weights"] == HF_WEIGHTS and _is_hf(target):
        state = _hf_names(target, state)
    layouts = _layouts(state, target)
    _check_saved_layouts(layouts, manifest)
    _apply_layouts(target, layouts)
    _check_aliases(target, manifest)
    _fill_ties(target, state)
    _check_keys(target, state, manifest)
    _check_dtypes(target, state)
    _take_saved_dtypes(target, state)
    try:
        target.load_state_dict(state, strict=True)
    except (RuntimeError, ValueError) as exc:  # shapes that differ, a layout that does not fit
        raise CheckpointError(
            f"the checkpoint does not fit {type(target).__name__}: {exc}; pass a model built "
            "with the configuration that was saved"
        ) from None
    report = _loaded_report(manifest, target)
    if report is not None:
        attach_report(target, report)
        _recompute_as_saved(target)
    return returned


def _recompute_as_saved(model: nn.Module) -> None:
    """Bond recomputation on a loaded model whose saved configuration asks for it (it is a
    wrapper of the blocks' forwards, which no weight file holds), and the lean causal-LM loss
    ``optimize`` gives every model it returns."""
    from comera_compile.training.causal_loss import use_lean_causal_loss

    use_lean_causal_loss(model)
    config, report = config_of(model), report_of(model)
    if getattr(report, "recompute", None) == "bonds" or (
            config is not None and config.recompute == "bonds"):
        from comera_compile.compile.bond_recompute import recompute_bonds

        recompute_bonds(model)
