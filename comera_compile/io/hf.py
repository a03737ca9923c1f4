"""Rebuilding a Hugging Face model from a checkpoint's ``config.json``, running no code:
only ``transformers`` model classes, from their own configuration class (never
``AutoConfig``), and only once the configuration's sizes agree with the saved weights."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from comera_compile.io.checks import _layouts
from comera_compile.io.format import (
    HF_CONFIG,
    HF_WEIGHTS,
    MANIFEST,
    CheckpointError,
    _own_file,
    _read_json,
    _sha256,
)


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
