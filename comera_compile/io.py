"""save / load: weights in safetensors, layer layouts in JSON, module structure in a pickle.

safetensors stores tensors only, so each tensorized layer's layout (format, modes, ranks)
goes to ``layouts.json``; the module tree (with every saved tensor replaced by an empty
meta tensor, so it is small) goes to ``structure.pt``. ``load`` rebuilds the tree and
assigns the weights, so ranks changed by ``prune_ranks`` come back exactly. Tied weights are
saved once and tied again on load.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import types
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from comera_compile.nn import TensorizedLayer
from comera_compile.passes.report import REPORT_ATTR

WEIGHTS, LAYOUTS, STRUCTURE = "model.safetensors", "layouts.json", "structure.pt"
FORMAT_VERSION = 1


def _reduce_graph_module(gm: torch.fx.GraphModule) -> tuple:
    """``GraphModule.__reduce__`` without its failure on string globals (torch 2.13 puts
    ``_Tensor_ = "Tensor"`` in the generated code's globals and cannot import it back)."""
    from torch.fx.graph_module import _format_import_statement, reduce_graph_module
    from torch.package import sys_importer

    code = gm.recompile()
    lines = []
    for name, value in code.globals.items():
        if isinstance(value, str):
            lines.append(f"{name} = {value!r}")
        else:
            lines.append(_format_import_statement(name, value, sys_importer))
    body = {k: v for k, v in gm.__dict__.items() if k != "_graph"}
    return reduce_graph_module, (body, "\n".join(lines) + "\n")


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, torch.fx.GraphModule):
            return _reduce_graph_module(obj)
        return NotImplemented


_PICKLE = types.SimpleNamespace(**{**vars(pickle), "Pickler": _Pickler})


def _unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "_orig_mod", model)  # under torch.compile


def layouts(model: nn.Module) -> dict[str, dict[str, Any]]:
    """``{qualified name: layer.layout()}`` for every tensorized layer."""
    return {n: m.layout() for n, m in model.named_modules() if isinstance(m, TensorizedLayer)}


def _skeleton(model: nn.Module) -> nn.Module:
    """A deep copy whose saved tensors are empty meta tensors (shapes and ties kept)."""
    memo: dict[int, Any] = {}
    for value in model.state_dict(keep_vars=True).values():
        if isinstance(value, torch.Tensor) and id(value) not in memo:
            meta = torch.empty_like(value, device="meta")
            if isinstance(value, nn.Parameter):
                meta = nn.Parameter(meta, requires_grad=value.requires_grad)
            memo[id(value)] = meta
    for module in model.modules():
        if isinstance(module, TensorizedLayer):
            memo[id(module._plans)] = {}  # plans are rebuilt on first use
    return copy.deepcopy(model, memo)


def _split_ties(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors to write (each once, contiguous, unshared) and ``{alias: saved key}``."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    by_identity: dict[int, str] = {}
    storages: set[int] = set()
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
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


def save(model: nn.Module, directory: str | os.PathLike) -> None:
    """Write ``model`` to ``directory`` (created if needed) so ``load`` rebuilds it exactly."""
    model = _unwrap(model)
    os.makedirs(directory, exist_ok=True)
    tensors, aliases = _split_ties(model.state_dict(keep_vars=True))
    save_file(tensors, os.path.join(directory, WEIGHTS))
    meta = {"format_version": FORMAT_VERSION, "layers": layouts(model), "aliases": aliases}
    with open(os.path.join(directory, LAYOUTS), "w") as f:
        json.dump(meta, f, indent=1)
    structure = {"model": _skeleton(model), "report": getattr(model, REPORT_ATTR, None)}
    torch.save(structure, os.path.join(directory, STRUCTURE), pickle_module=_PICKLE)


def _retie(model: nn.Module, aliases: dict[str, str]) -> None:
    for alias, key in aliases.items():
        parent_name, _, attr = alias.rpartition(".")
        parent = model.get_submodule(parent_name)
        src_parent, _, src_attr = key.rpartition(".")
        source = model.get_submodule(src_parent)
        if src_attr in source._parameters:
            parent._parameters[attr] = source._parameters[src_attr]
        else:
            parent._buffers[attr] = source._buffers[src_attr]


def _read_state(directory: str | os.PathLike, device: str | torch.device) -> tuple[dict, dict]:
    with open(os.path.join(directory, LAYOUTS)) as f:
        meta = json.load(f)
    state: dict[str, Any] = load_file(os.path.join(directory, WEIGHTS), device=str(device))
    for alias, key in meta["aliases"].items():
        state[alias] = state[key]
    for name, layout in meta["layers"].items():
        state[f"{name}._extra_state" if name else "_extra_state"] = layout
    return state, meta


def load(
    directory: str | os.PathLike,
    model: nn.Module | None = None,
    map_location: str | torch.device = "cpu",
) -> nn.Module:
    """Rebuild the model saved in ``directory`` (the structure file is a pickle: load only
    directories you trust). With ``model``, load the weights into it instead: its tensorized
    layers resize to the saved ranks, and a layer of other modes raises LayoutMismatchError
    naming both layouts."""
    state, meta = _read_state(directory, map_location)
    if model is not None:
        model.load_state_dict(state, strict=True)
        return model
    structure = torch.load(os.path.join(directory, STRUCTURE), weights_only=False,
                           map_location="meta")
    model = structure["model"]
    if structure["report"] is not None:  # a GraphModule does not pickle extra attributes
        setattr(model, REPORT_ATTR, structure["report"])
    for key, value in model.state_dict().items():  # other modules' extra state was pickled
        if not isinstance(value, torch.Tensor):
            state.setdefault(key, value)
    model.load_state_dict(state, strict=True, assign=True)
    _retie(model, meta["aliases"])
    return model
