"""Rank-adaptive training under FSDP2 (``torch.distributed.fsdp.fully_shard``), pruning included.

FSDP2 lays out its collectives from the shapes at wrap time, so a prune gathers, cuts and
re-shards each changed group; the rank gates stay whole on every rank. 1-D meshes only.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from comera_compile.nn import PruneResult, TensorizedLayer, tensorized_layers
from comera_compile.nn.base import LAYOUT_KEY, decode_layout
from comera_compile.nn.gates import alive
from comera_compile.training.groups import group_layout, regroup
from comera_compile.training.pruning import prune_layer

__all__ = ["cut_to_checkpoint", "full_state_dict", "gates_of", "is_sharded", "load_checkpoint",
           "prune_sharded", "save_checkpoint", "shard"]


def is_sharded(model: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``model`` or any module inside it."""
    return any(isinstance(m, FSDPModule) for m in model.modules())


def gates_of(model: nn.Module) -> list[nn.Parameter]:
    """Every rank gate of the model's tensorized layers (the parameters kept whole)."""
    return [g for layer in tensorized_layers(model).values() for g in layer.gates]


def _default_blocks(model: nn.Module) -> list[nn.Module]:
    """A Hugging Face model's own unit of sharding (its ``_no_split_modules``: the
    decoder layers), else none: the root alone holds everything."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if m is not model and type(m).__name__ in names]


def shard(model: nn.Module, blocks: Iterable[nn.Module] | Callable[[nn.Module], bool] | None = None,
          **fully_shard_kwargs: Any) -> nn.Module:
    """``fully_shard`` each block, then ``model`` itself, keeping the rank gates whole.

    ``blocks``: the modules (or a predicate) sharded as groups; keywords go to every
    ``fully_shard``. Call it before building the optimizer and the trainer.
    """
    for refused in ("shard_placement_fn", "ignored_params"):
        if fully_shard_kwargs.get(refused) is not None:
            raise ValueError(
                f"shard() sets no {refused}: a prune re-shards every core on dim 0, and the "
                "rank gates are the ignored parameters; drop that argument"
            )
    mesh = fully_shard_kwargs.get("mesh")
    if mesh is not None and mesh.ndim != 1:
        raise ValueError(f"shard() takes a 1-D mesh (plain FSDP), got a {mesh.ndim}-D mesh")
    if is_sharded(model):
        raise ValueError("the model is already sharded: call shard() once, on the unwrapped model")
    for name, layer in tensorized_layers(model).items():
        if getattr(layer, "cache_rows", 0) and not layer.cache_filled:
            raise ValueError(
                f"'{name}' has a hot-row cache that is not filled yet: a cache filled inside a "
                "sharded forward would be lost with the unsharded parameters; fill it before "
                f"shard() with model.get_submodule('{name}').fill_cache(ids) (ids from your "
                "data, the same on every rank)"
            )
    if blocks is None:
        chosen = _default_blocks(model)
    elif callable(blocks):
        chosen = [m for m in model.modules() if m is not model and blocks(m)]
    else:
        chosen = list(blocks)
    gates = gates_of(model)
    ignored = set(gates)
    for block in chosen:
        fully_shard(block, ignored_params=ignored, **fully_shard_kwargs)
    fully_shard(model, ignored_params=ignored, **fully_shard_kwargs)
    sharded = next((p for p in model.parameters() if isinstance(p, DTensor)), None)
    if sharded is not None:
        for gate in gates:  # FSDP moves only what it manages
            gate.data = gate.data.to(sharded.device)
    _GateGradMean(gates).install()
    return model


class _GateGradMean:
    """Averages the gates' gradients over ranks at the end of each backward, in one
    all-reduce (FSDP does not reduce ignored parameters; DDP would average them)."""

    def __init__(self, gates: list[nn.Parameter]) -> None:
        self.gates = gates
        self._queued = False

    def install(self) -> None:
        for gate in self.gates:
            gate.register_post_accumulate_grad_hook(self._on_grad)

    def _on_grad(self, _: Tensor) -> None:
        if not self._queued:  # once per backward, after every gradient is in
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._reduce)

    @torch.no_grad()
    def _reduce(self) -> None:
        self._queued = False
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return
        grads = [g.grad if g.grad is not None else torch.zeros_like(g) for g in self.gates]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        for gate, value in zip(self.gates, flat.split([g.numel() for g in self.gates])):
            gate.grad = value.view_as(gate).clone()


# ----- prune under sharding ------------------------------------------------------------------
def _groups(model: nn.Module) -> Iterator[Any]:
    """Every FSDP parameter group of the model, in module order (the same on every rank)."""
    seen = set()
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        if id(state) in seen:
            continue
        seen.add(id(state))
        yield from state._fsdp_param_groups


def _has_dead(layer: TensorizedLayer) -> bool:
    """Whether a prune would cut this layer (a gate with an entry at or under threshold)."""
    return any(not bool(alive(g, layer.threshold).all()) for g in layer.gates)


def _holds(group: Any, layer: TensorizedLayer) -> bool:
    return any(fp._module_info.module is layer.cores for fp in group.fsdp_params)


def _set_on_modules(fsdp_param: Any, param: nn.Parameter) -> None:
    info = fsdp_param._module_info
    setattr(info.module, info.param_name, param)
    for module, name in zip(info.shared_modules, info.shared_param_names):
        setattr(module, name, param)


def _move_params(optimizer: torch.optim.Optimizer | None, moves: dict[nn.Parameter, nn.Parameter],
                 convert: Callable[[Tensor, nn.Parameter], Tensor]) -> None:
    """Swap parameters in the optimizer's groups, their state converted along."""
    if optimizer is None:
        return
    for group in optimizer.param_groups:
        group["params"] = [moves.get(p, p) for p in group["params"]]
    for old, new in moves.items():
        if old in optimizer.state:
            state = optimizer.state.pop(old)
            optimizer.state[new] = {k: convert(v, new) for k, v in state.items()}


def _to_full(value: Any, _: nn.Parameter) -> Any:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _to_sharded(value: Any, param: nn.Parameter) -> Any:
    """State laid out like the full parameter, sharded like it (no communication: every
    rank holds the same full tensor and keeps its own chunk)."""
    if torch.is_tensor(value) and not isinstance(value, DTensor) and value.shape == param.shape:
        return distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
    return value


def _gather(group: Any, optimizer: torch.optim.Optimizer | None) -> list[nn.Parameter]:
    """The group's parameters as plain full tensors, registered on their modules in place
    of the sharded ones; optimizer state follows."""
    if not group.is_sharded:
        group.reshard()
    moves = {}
    for fsdp_param in group.fsdp_params:
        sharded = fsdp_param.sharded_param
        plain = nn.Parameter(sharded.detach().full_tensor(), sharded.requires_grad)
        _set_on_modules(fsdp_param, plain)
        fsdp_param._post_load_hook_handle.remove()
        moves[sharded] = plain
    _move_params(optimizer, moves, _to_full)
    return list(moves.values())


def _reshard(group: Any, params: list[nn.Parameter],
             optimizer: torch.optim.Optimizer | None) -> None:
    """Shard the group again at the parameters' new shapes, keeping the group object."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import _get_param_module_infos

    old = group.fsdp_params
    infos = _get_param_module_infos(params, group.modules)
    group.fsdp_params = [
        FSDPParam(
            param, info, before.mesh_info, group.post_forward_mesh_info, group.device,
            None, group.mp_policy, group.offload_policy,
        )
        for param, info, before in zip(params, infos, old)
    ]
    for before, after in zip(old, group.fsdp_params):
        after._param_fqn = before._param_fqn
    group._all_gather_output = torch.empty(0, device=group.device)
    group._reset_sharded_params = False
    group.lazy_init()
    moves = {p: fp.sharded_param for p, fp in zip(params, group.fsdp_params)}
    _move_params(optimizer, moves, _to_sharded)


@torch.no_grad()
def prune_sharded(model: nn.Module,
                  optimizer: torch.optim.Optimizer | None = None) -> dict[str, PruneResult]:
    """``prune_model`` for a model sharded by ``shard``: each FSDP group holding a layer
    with dead channels is gathered, pruned and sharded again, optimizer state included.
    Collective: every rank must call it at the same step."""
    layers = {n: lay for n, lay in tensorized_layers(model).items() if _has_dead(lay)}
    results: dict[str, PruneResult] = {}
    for group in list(_groups(model)):
        mine = {n: lay for n, lay in layers.items() if _holds(group, lay)}
        if not mine:
            continue
        try:
            params = _gather(group, optimizer)
            for name, layer in mine.items():
                result = prune_layer(layer, optimizer)
                if result:
                    results[name] = result
            _reshard(group, params, optimizer)
        except Exception as exc:
            rank = dist.get_rank() if dist.is_initialized() else 0
            raise RuntimeError(
                f"sharded prune failed on rank {rank} in FSDP group {group._module_fqn!r} "
                f"({type(exc).__name__}: {exc}); a collective that times out means another "
                "rank failed or left the prune. The model is now partly pruned: resume from "
                "the last checkpoint"
            ) from exc
    return results


# ----- checkpoints ---------------------------------------------------------------------------
def full_state_dict(model: nn.Module, cpu_offload: bool = True) -> dict[str, Any]:
    """The whole model's state dict, layouts included (collective). With ``cpu_offload`` only
    rank 0 gets it, on the CPU; load it into an unsharded model of the same build to
    ``comera_compile.save`` it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)
    return get_model_state_dict(model, options=options)


def cut_to_checkpoint(model: nn.Module, checkpoint_id: str, prefix: str = "model.") -> int:
    """Cut a freshly built, unsharded model's layers to the ranks saved in a
    ``torch.distributed.checkpoint`` directory, before ``shard``, so the sharded load finds
    every tensor at its saved shape. ``prefix``: where the model's state sits in the saved
    dict. Collective where a process group is up. Returns how many layers changed."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
    layers = tensorized_layers(model)
    wanted = {f"{prefix}{name}.{LAYOUT_KEY}": name for name in layers}
    state = {key: torch.empty(metadata[key].size, dtype=torch.uint8)
             for key in wanted
             if key in metadata}
    if layers and not state:
        raise ValueError(
            f"no tensorized layer layouts under '{prefix}' in {checkpoint_id}: saved by "
            "save_checkpoint (the model under 'model.'), from a model of the same build?"
        )
    dcp.load(state, checkpoint_id=checkpoint_id)
    changed = 0
    for key, value in state.items():
        layer = layers[wanted[key]]
        before = layer.ranks
        layer._adopt_layout(decode_layout(value))
        changed += layer.ranks != before
    return changed


def _checkpoint_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def _blob(value: Any) -> io.BytesIO:
    """Nested lists of any length, stored whole as one object (the checkpoint's loader
    fills only entries whose structure it already knows)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return buffer


def _unblob(buffer: io.BytesIO) -> Any:
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def save_checkpoint(checkpoint_id: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                    trainer: Any | None = None) -> None:
    """Save a sharded model, its optimizer (state and groups) and the trainer's state
    (stage, schedule, history) to a ``torch.distributed.checkpoint`` directory.
    Collective."""
    import torch.distributed.checkpoint as dcp

    state = _checkpoint_state(model, optimizer)
    state["param_groups"] = _blob(group_layout(model, optimizer, plain=False))
    if trainer is not None:
        state["trainer"] = _blob(trainer.state_dict())
    dcp.save(state, checkpoint_id=checkpoint_id)


def load_checkpoint(checkpoint_id: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                    trainer: Any | None = None) -> None:
    """Resume from ``save_checkpoint``: ``model`` was cut to the saved ranks
    (``cut_to_checkpoint``) and sharded, ``optimizer`` and ``trainer`` built on it. The
    optimizer is regrouped as saved (rates included). Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    groups = {"param_groups": io.BytesIO()}
    dcp.load(groups, checkpoint_id=checkpoint_id)
    regroup(model, optimizer, _unblob(groups["param_groups"]))
    state = _checkpoint_state(model, optimizer)
    if trainer is not None:
        state["trainer"] = io.BytesIO()
    dcp.load(state, checkpoint_id=checkpoint_id)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    if trainer is not None:
        trainer.load_state_dict(_unblob(state["trainer"]))
