"""Compile a model's repeated blocks, one graph for all blocks of the same shapes.

A first compile then costs about one block, not the depth; steps run a few percent slower,
so by default only shapes ``MIN_SHARED`` blocks share are compiled.
"""

from __future__ import annotations

import inspect
import types
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from comera_compile.compile.policy.rank_dims import bond_dims, symbolic_layers
from comera_compile.nn import TensorizedLayer


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The members of ``model``'s stacks (module docstring), in model order; a stack inside
    a block of another is left to that block's graph. [] where there is none."""
    blocks: list[nn.Module] = []
    inside: set[int] = set()  # modules within a chosen block
    for module in model.modules():
        if id(module) in inside or not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        members = list(module.children())
        if len(members) < 2 or len({type(m) for m in members}) != 1:
            continue
        if isinstance(members[0], TensorizedLayer) or not all(map(_holds_tensorized, members)):
            continue
        blocks.extend(members)
        inside.update(id(m) for member in members for m in member.modules())
    return blocks


MIN_SHARED = 3
"""Blocks per distinct set of shapes from which compiling blocks is the default."""


def _shapes(block: nn.Module, symbolic_ranks: bool) -> tuple:
    """What a block's graph is specialised to: its parameter and buffer shapes, the bonds
    of its planned layers left out where they are symbolic (``compile.policy.rank_dims``)."""
    bonds = {}
    if symbolic_ranks:
        bonds = {id(t): dims for layer in symbolic_layers(block) for t, dims in bond_dims(layer)}
    return type(block), tuple(
        (name, tuple(None if d in bonds.get(id(t), ()) else s for d, s in enumerate(t.shape)))
        for name, t in (*block.named_parameters(), *block.named_buffers()))


def distinct_shapes(blocks: list[nn.Module], symbolic_ranks: bool = True) -> int:
    """How many graphs the blocks need at least: their distinct sets of parameter and
    buffer shapes (a block's graph is specialised to them), ranks apart where symbolic."""
    return len({_shapes(b, symbolic_ranks) for b in blocks})


def shared_blocks(blocks: list[nn.Module], symbolic_ranks: bool = True) -> list[nn.Module]:
    """The blocks whose shapes ``MIN_SHARED`` or more of ``blocks`` share, in model order:
    those the default compiles (module docstring); the others run eager."""
    shapes = [_shapes(b, symbolic_ranks) for b in blocks]
    sharing = Counter(shapes)
    return [b for b, shape in zip(blocks, shapes) if sharing[shape] >= MIN_SHARED]


def blocks_pay(blocks: list[nn.Module], symbolic_ranks: bool = True) -> bool:
    """Whether compiling blocks rather than the whole model pays by default: some graph
    would serve ``MIN_SHARED`` blocks or more (module docstring)."""
    return bool(shared_blocks(blocks, symbolic_ranks))


def why_not_blocks(blocks: list[nn.Module], symbolic_ranks: bool = True) -> str:
    """Why the default compiles a model with these blocks whole ("" where blocks pay)."""
    if not blocks or blocks_pay(blocks, symbolic_ranks):
        return ""
    return (f"its {len(blocks)} blocks have {distinct_shapes(blocks, symbolic_ranks)} "
            f"shapes, and blocks compile where {MIN_SHARED} or more share one")


def _holds_tensorized(module: nn.Module) -> bool:
    return any(isinstance(m, TensorizedLayer) for m in module.modules())


def _call_block(block: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The frame a block's compile starts from: ours, so dynamo traces torch's own block
    classes (``nn.TransformerEncoderLayer``) whole rather than skipping their frames."""
    return block._call_impl(*args, **kwargs)


class BlockCompile:
    """The model's call with its blocks compiled: ``compile`` (``torch.compile`` with the
    caller's settings) is applied to one block-calling function shared by every block, so
    blocks of equal shapes share its graphs. Each block runs compiled only inside a call
    of this object; called directly (the model's eager form), blocks run eager."""

    def __init__(self, model: nn.Module, blocks: list[nn.Module],
                 compile: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        self.model, self.blocks = model, blocks
        self.compiled_blocks = list(blocks)  # those that run compiled (``select``)
        self.drops_cache = _takes_use_cache(model)  # read once: not per training call
        self.active = self.installed = False
        # a code object of this model's own: dynamo keeps its graphs per code object, so
        # two models never share (nor use up) each other's cache entries
        call = types.FunctionType(_call_block.__code__.replace(), _call_block.__globals__,
                                  _call_block.__name__)
        self.compiled_block = compile(call)

    def select(self, blocks: list[nn.Module]) -> None:
        """Compile only ``blocks`` (of ``self.blocks``); the others run eager. Before the
        first call: blocks are installed then."""
        if self.installed:
            raise RuntimeError("select the compiled blocks before the first call")
        chosen = {id(b) for b in blocks}
        self.compiled_blocks = [b for b in self.blocks if id(b) in chosen]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.installed:  # at first use: a caller that compiles whole never installs
            for block in self.compiled_blocks:
                block._compiled_call_impl = _BlockCall(self, block)
            self.installed = True
        self.active = True
        try:
            if self.drops_cache:
                kwargs = _without_training_cache(self.model, kwargs)
            return self.model._call_impl(*args, **kwargs)
        finally:
            self.active = False

    def describe(self) -> str:
        names = " and ".join(sorted({type(b).__name__ for b in self.blocks}))
        compiled, total = len(self.compiled_blocks), len(self.blocks)
        if compiled == total:
            return f"{total} {names} blocks compiled, the rest eager"
        return (f"{compiled} of {total} {names} blocks compiled (the others have shapes "
                f"fewer than {MIN_SHARED} share), the rest eager")


def _takes_use_cache(model: nn.Module) -> bool:
    """Whether ``model.forward`` takes ``use_cache`` (a Hugging Face model's does)."""
    try:
        return "use_cache" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _without_training_cache(model: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with ``use_cache=False`` for a training call of a model whose config asks
    for a key-value cache (module docstring); as given otherwise or when the caller set it.
    The model's forward takes ``use_cache`` (``_takes_use_cache``, checked once)."""
    if ("use_cache" in kwargs or not getattr(getattr(model, "config", None), "use_cache", False)
            or not (model.training and torch.is_grad_enabled())):
        return kwargs
    return {**kwargs, "use_cache": False}


class _BlockCall:
    """A block's call: compiled within its model's ``BlockCompile`` call, else eager."""

    def __init__(self, owner: BlockCompile, block: nn.Module) -> None:
        self.owner, self.block = owner, block

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.owner.active and not _carries_cache(args, kwargs):
            return self.owner.compiled_block(self.block, *args, **kwargs)
        return self.block._call_impl(*args, **kwargs)


def _carries_cache(args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether a block call carries a key-value cache object (Hugging Face's ``Cache``,
    known by its ``get_seq_length``): such calls run eager (module docstring)."""
    return any(hasattr(v, "get_seq_length") for v in (*args, *kwargs.values()))
