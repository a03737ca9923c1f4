"""save / load: weights in safetensors, everything else in JSON; nothing runs code on load."""

from __future__ import annotations

import dataclasses
import glob
import os
import secrets

import torch
from safetensors.torch import save_file
from torch import nn

from comera_compile.config import config_of
from comera_compile.io.checks import (
    _apply_layouts,
    _check_aliases,
    _check_dtypes,
    _check_keys,
    _check_saved_layouts,
    _fill_ties,
    _layouts,
    _loaded_report,
    _saved_layouts,
    _take_saved_dtypes,
)
from comera_compile.io.format import (
    FORMAT_VERSION,
    HF_CONFIG,
    HF_WEIGHTS,
    MANIFEST,
    CheckpointError,
    CheckpointLayoutError,
    _header_sha256,
    _is_hf,
    _read_manifest,
    _read_weights,
    _replace_atomically,
    _sha256,
    _split_ties,
    _unwrap,
    _write_json,
)
from comera_compile.io.hf import _build_hf_base, _hf_names
from comera_compile.passes.report import attach_report, report_of

__all__ = ["CheckpointError", "CheckpointLayoutError", "load", "save"]


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


def load(directory: str | os.PathLike, model: nn.Module | None = None,
         map_location: str | torch.device = "cpu", verify: bool = True) -> nn.Module:
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
        from comera_compile.compile.cpu.host_memory import cache_for_training

        recompute_bonds(model)
        if config is None or config.compile_options.host_memory == "auto":
            cache_for_training(model)
