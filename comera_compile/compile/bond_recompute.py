"""Bond recomputation, as CoLA-M does it: per block, keep the block's input and the rank-wide
bond of each compressed layer, and recompute the rest of the block in backward. A compressed
model's weights and optimizer state are small; the activations a step keeps are not, and the
bonds are narrow and the cheap half of each layer to remake."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from comera_compile.compile.policy.blocks import (
    _carries_cache,
    _takes_use_cache,
    _without_training_cache,
    repeated_blocks,
)
from comera_compile.nn import CoLALinear, TTEmbedding
from comera_compile.nn.cola_linear import bond_product
from comera_compile.training.causal_loss import drop_lean_causal_loss, use_lean_causal_loss

_BOND_OPS = {torch.ops.comera.bond_product.default}
_ATTENTION_OPS = {getattr(torch.ops.aten, name).default for name in (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    if hasattr(torch.ops.aten, name)}


def _tracing(op: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the policy is asked while AOT autograd traces a compiled graph."""
    from torch.utils import checkpoint as torch_checkpoint

    is_compiling = getattr(torch_checkpoint, "_is_compiling", None)
    return bool(is_compiling and is_compiling(op, args, kwargs))


def keep_bonds(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The selective checkpoint policy: save the bond products and the fused attentions'
    outputs, recompute the rest. An attention's output is as narrow as the block's input
    and the costliest op of the block to redo. In a compiled graph a random op (a dropout,
    with its tuple of outputs) is saved too: the graph's own passes keep random values
    rather than draw them again (``compile.recompute``), and a tuple-valued op marked saved
    whose outputs were marked recomputed could not be partitioned. Eager, the checkpoint
    replays the random state instead, so dropouts are recomputed."""
    if op in _BOND_OPS or op in _ATTENTION_OPS:
        return CheckpointPolicy.MUST_SAVE
    if torch.Tag.nondeterministic_seeded in getattr(op, "tags", ()) and _tracing(
            op, args, kwargs):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


_contexts = functools.partial(create_selective_checkpoint_contexts, keep_bonds)


class RecomputedForward:
    """A block's ``forward`` run under the bond-keeping checkpoint while grad is on. In
    ``no_grad`` / inference it is the block's own forward, with nothing to recompute; so is a
    call that carries a key-value cache, which the block's forward appends to (a recompute
    would append again and see other shapes)."""

    def __init__(self, forward: Any) -> None:
        self.forward = forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled() or _carries_cache(args, kwargs):
            return self.forward(*args, **kwargs)
        return checkpoint(self.forward, *args, use_reentrant=False, context_fn=_contexts,
                          **kwargs)


def _no_training_cache(model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook: a training call of a Hugging Face decoder builds no key-value cache
    (``use_cache=False``, as Hugging Face's own gradient checkpointing does), so its blocks
    recompute; the cache of a training call is never read."""
    return args, _without_training_cache(model, kwargs)


def recompute_bonds(model: nn.Module) -> int:
    """Run each of ``model``'s blocks under bond recomputation (module docstring), in place,
    and give a Hugging Face causal LM the lean loss; returns how many blocks (0: the model
    has no stack of blocks). Calling it again changes nothing."""
    blocks = repeated_blocks(model)
    use_lean_causal_loss(model)
    hooked = any(h is _no_training_cache for h in model._forward_pre_hooks.values())
    if blocks and not hooked and _takes_use_cache(model):
        model.register_forward_pre_hook(_no_training_cache, with_kwargs=True)
    if blocks:
        for table in model.modules():
            if isinstance(table, TTEmbedding) and table.lookup_outgrows_rows:
                table.recompute_lookup = True
    for block in blocks:
        if not isinstance(block.__dict__.get("forward"), RecomputedForward):
            block.forward = RecomputedForward(block.forward)
        for layer in block.modules():
            if isinstance(layer, CoLALinear):
                layer.keeps_bond = True
    return len(blocks)


def stop_recomputing(model: nn.Module) -> None:
    """Undo :func:`recompute_bonds`: every block keeps what autograd keeps again."""
    drop_lean_causal_loss(model)
    for key, hook in list(model._forward_pre_hooks.items()):
        if hook is _no_training_cache:
            del model._forward_pre_hooks[key]
            model._forward_pre_hooks_with_kwargs.pop(key, None)
    for module in model.modules():
        if isinstance(module.__dict__.get("forward"), RecomputedForward):
            del module.forward
        if isinstance(module, CoLALinear):
            module.__dict__.pop("keeps_bond", None)
        if isinstance(module, TTEmbedding):
            module.__dict__.pop("recompute_lookup", None)


def kept_bytes(model: nn.Module, example_inputs: Any) -> int:
    """Bytes one training forward of ``model`` on ``example_inputs`` (a tensor, a tuple of
    positional inputs or a dict of keyword inputs) keeps for backward, each
    storage once and the parameters left out. The forward runs in training mode on the first
    row of the batch and the count is scaled by the batch size (activations grow with it),
    so that the measurement itself never holds a full batch's activations (a model whose
    inputs do not all lead with the batch runs on them whole); random state and the model's
    mode are left as they were."""
    if isinstance(example_inputs, dict):
        args, kwargs = (), dict(example_inputs)
    else:
        args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (
            example_inputs,)
        kwargs = {}
    tensors = [t for t in (*args, *kwargs.values()) if torch.is_tensor(t) and t.dim()]
    rows = tensors[0].shape[0] if tensors else 1
    cut = lambda v: v[:1] if torch.is_tensor(v) and v.dim() and v.shape[0] == rows else v  # noqa: E731
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        # Detached: a saved output packed as itself would tie the graph into a cycle through
        # C++ that Python's collector never frees, as no backward runs here to break it.
        if t.layout == torch.strided and t.device.type != "meta":
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params:
                storages[ptr] = t.untyped_storage().nbytes()
        return t.detach()

    def forward(args: tuple, kwargs: dict) -> None:
        with torch.random.fork_rng(), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(*args, **kwargs)

    was_training = model.training
    model.train()
    try:
        try:
            forward(tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()})
            return sum(storages.values()) * rows
        except Exception:  # inputs whose first dims are not all the batch: count it whole
            storages.clear()
            forward(args, kwargs)
            return sum(storages.values())
    finally:
        model.train(was_training)


def recompute_pays(model: nn.Module, example_inputs: Any) -> bool:
    """``recompute="auto"``: whether bond recomputation is worth its extra forward of each
    block's wide half. It is where the model has a stack of blocks holding CoLA layers (whose
    bonds are narrow) and a training step on the example batch keeps more for backward than
    the model's parameter state weighs (weights, gradients and AdamW's two moments): there
    activations are what the step's memory is made of. Where they weigh less (small
    batches), recomputing would cost time and save little."""
    blocks = repeated_blocks(model)
    if not any(isinstance(m, CoLALinear) for block in blocks for m in block.modules()):
        return False
    state = 4 * sum(p.numel() * p.element_size() for p in model.parameters())
    return kept_bytes(model, example_inputs) > state


def recomputed_blocks(model: nn.Module) -> int:
    """How many of ``model``'s modules run under bond recomputation."""
    return sum(isinstance(m.__dict__.get("forward"), RecomputedForward) for m in model.modules())


__all__ = ["RecomputedForward", "bond_product", "keep_bonds", "kept_bytes",
           "recompute_bonds", "recompute_pays", "recomputed_blocks", "stop_recomputing"]
