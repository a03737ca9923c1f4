"""save / load: weights in safetensors, everything else in JSON; nothing runs code on load.

A checkpoint is a directory:

- ``model-<id>.safetensors``: the state dict, each tied tensor once. Every tensorized layer's
  layout (format, modes, ranks after pruning) rides in it as the layer's ``_extra_state``, a
  byte tensor of JSON, so ``model.save_pretrained`` output carries the layouts too.
- ``comera.json``: which weights file is current (with its size), aliases of tied tensors,
  the model's class and ``optimize``'s report. Replacing it is the one atomic step that
  commits a save: a crash before it leaves the previous checkpoint as it was.
- ``config.json`` for Hugging Face models, as ``save_pretrained`` writes it.

Loading trusts nothing in the directory: a damaged or crafted checkpoint raises
``CheckpointError`` naming the problem, only a weights file of the saved name pattern in
the directory itself is read, only ``transformers`` model classes are built, and a
``config.json`` whose sizes disagree with the weights is refused before anything is built.

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
import re
import secrets
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
from comera_compile.nn.base import decode_layout
from comera_compile.nn.tied_head import TIED_HEAD
from comera_compile.passes.report import OptimizeReport, attach_report, report_of
from comera_compile.passes.rewrite import LINEAR_CLASSES, apply_layouts

MANIFEST, HF_CONFIG, HF_WEIGHTS = "comera.json", "config.json", "model.safetensors"
FORMAT_VERSION = 2
COMPILED_PREFIX = "_orig_mod."
EXTRA = "_extra_state"
SAVED_WEIGHTS = re.compile(r"model-[0-9a-f]{12}\.safetensors")  # as save names them
OUR_LAYERS = (TensorizedLayer, SplitMultiheadAttention, TiedEmbeddingHead)
TENSORIZED_FORMATS = {*LINEAR_CLASSES, TT_EMBEDDING}
KNOWN_FORMATS = {*TENSORIZED_FORMATS, SPLIT_ATTENTION, TIED_HEAD}
LIST_FIELDS = ("ranks", "in_modes", "out_modes", "row_modes", "col_modes")
INT_FIELDS = ("in_features", "out_features", "num_embeddings", "embedding_dim")
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
        manifest = _read_json(path)
        if not isinstance(manifest, dict):
            raise CheckpointError(
                f"{path} holds a JSON {type(manifest).__name__}, not an object; save the "
                "model again"
            )
        if manifest.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(
                f"{path} has format_version {manifest.get('format_version')!r}; this version "
                f"of comera_compile reads {FORMAT_VERSION}: save the model again with it"
            )
        _check_manifest(path, manifest)
        return manifest
    if os.path.exists(os.path.join(directory, HF_WEIGHTS)):
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
    if size is not None and (type(size) is not int or size < 0):
        raise bad("weights_bytes", "a byte count")
    aliases = manifest.get("aliases")
    if not isinstance(aliases, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()
    ):
        raise bad("aliases", "an object of tensor names")
    report = manifest.get("report")
    fields = {f.name for f in dataclasses.fields(OptimizeReport)}
    if report is not None and (not isinstance(report, dict) or not set(report) <= fields):
        raise bad("report", f"null or an object with the keys {sorted(fields)}")


def _read_weights(directory: str, manifest: dict, device: str) -> dict[str, torch.Tensor]:
    path = os.path.join(directory, manifest["weights"])
    if os.path.dirname(os.path.realpath(path)) != os.path.realpath(directory):
        raise CheckpointError(
            f"{path} links outside {directory!r}; only the directory's own files are read: "
            "copy the weights file into it"
        )
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

    _read_json(os.path.join(directory, HF_CONFIG))  # bad JSON is named as ours
    try:
        config = transformers.AutoConfig.from_pretrained(directory)
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
    tensors that differ; a layer of other modes raises ``CheckpointLayoutError`` (both a
    ``CheckpointError`` and a ``LayoutMismatchError``).
    """
    directory = os.fspath(directory)
    manifest = _read_manifest(directory)
    state = _read_weights(directory, manifest, str(map_location))
    returned = _build_hf_base(directory, manifest, state) if model is None else model
    target = _unwrap(returned)
    if manifest["weights"] == HF_WEIGHTS and _is_hf(target):
        state = _hf_names(target, state)
    _apply_layouts(target, _layouts(state, target))
    _fill_ties(target, state)
    _check_keys(target, state, manifest)
    _take_saved_dtypes(target, state)
    try:
        target.load_state_dict(state, strict=True)
    except (RuntimeError, ValueError) as exc:  # shapes that differ, a layout that does not fit
        raise CheckpointError(
            f"the checkpoint does not fit {type(target).__name__}: {exc}; pass a model built "
            "with the configuration that was saved"
        ) from None
    if manifest.get("report"):
        attach_report(target, OptimizeReport(**manifest["report"]))
        _recompute_as_saved(target)
    return returned


def _recompute_as_saved(model: nn.Module) -> None:
    """Bond recomputation on a loaded model whose saved configuration asks for it (it is a
    wrapper of the blocks' forwards, which no weight file holds)."""
    config = config_of(model)
    if config is not None and config.recompute == "bonds":
        from comera_compile.compile.bond_recompute import recompute_bonds

        recompute_bonds(model)
