"""Dropout for CPU graphs: each mask element hashed from its index and a per-call key. aten's
CPU dropout draws from a serial generator on one core; the hash fuses into the kernel."""

from __future__ import annotations

import hashlib
import inspect
import math
from pathlib import Path

import torch
from torch import Tensor, fx
from torch._inductor.custom_graph_pass import CustomGraphPass

aten = torch.ops.aten

BITS = 24  # hash bits compared with the threshold
WEYL = -1640531535  # 0x9E3779B1 as int32: spreads consecutive indices over the 32 bits
FMIX = (-2048144789, -1028477387)  # murmur3 fmix32's 0x85EBCA6B, 0xC2B2AE35 as int32


def _shift_right(h: Tensor, bits: int) -> Tensor:
    """A logical right shift of int32 lanes (torch's ``>>`` is arithmetic)."""
    return (h >> bits) & ((1 << (32 - bits)) - 1)


def _fmix32(h: Tensor) -> Tensor:
    h = h ^ _shift_right(h, 16)
    h = h * FMIX[0]
    h = h ^ _shift_right(h, 13)
    h = h * FMIX[1]
    return h ^ _shift_right(h, 16)


def keep_mask(shape: torch.Size, p: float, device: torch.device) -> Tensor:
    """A boolean mask whose elements are True with probability ``1 - round(p*2^24)/2^24``."""
    keys = torch.randint(-(2**31), 2**31, (2,), dtype=torch.int32, device=device)
    index = torch.arange(math.prod(shape), dtype=torch.int64, device=device).view(shape)
    h = _fmix32(index.to(torch.int32) * WEYL + keys[0])  # the low 32 bits of the index
    h = _fmix32(h ^ keys[1])
    return (h & ((1 << BITS) - 1)) >= round(p * (1 << BITS))


def native_dropout(input: Tensor, p: float, train: bool | None) -> tuple[Tensor, Tensor]:
    """``aten.native_dropout`` with masks from :func:`keep_mask` (same outputs otherwise)."""
    if not train or p == 0:
        return input.clone(), torch.ones_like(input, dtype=torch.bool)
    if p == 1:
        return torch.zeros_like(input), torch.zeros_like(input, dtype=torch.bool)
    keep = keep_mask(input.shape, p, input.device)
    return input * keep * (1.0 / (1.0 - p)), keep


def hashed_dropout(input: Tensor, p: float = 0.5, training: bool = True,
                   inplace: bool = False) -> Tensor:
    """``F.dropout`` (out of place) with the mask of :func:`keep_mask`."""
    if not 0 <= p <= 1:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    return native_dropout(input, p, training)[0] if training else input


def hash_dropouts(gm: fx.GraphModule) -> int:
    """Point a dynamo graph's out-of-place ``F.dropout`` calls at :func:`hashed_dropout`;
    returns how many. An in-place one (its input must change) is left to the table."""
    import torch.nn.functional as F

    count = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not F.dropout:
            continue
        inplace = node.kwargs.get("inplace", node.args[3] if len(node.args) > 3 else False)
        if inplace is False:
            node.target = hashed_dropout
            count += 1
    if count:
        gm.recompile()
    return count


def may_drop_out(gm: fx.GraphModule) -> bool:
    """Whether a dynamo graph may call dropout: a dropout function or module, or a call
    (an attention) whose ``dropout_p`` is not the constant 0."""
    for node in gm.graph.nodes:
        if node.op == "call_module":
            target = type(gm.get_submodule(node.target)).__name__
        elif node.op in ("call_function", "call_method"):
            target = getattr(node.target, "__name__", str(node.target))
        else:
            continue
        if target != "hashed_dropout" and ("dropout" in target.lower()
                                            or "bernoulli" in target.lower()):
            return True
        p = _dropout_p(node)
        if not (isinstance(p, (int, float)) and p == 0):
            return True
    return False


def _dropout_p(node: fx.Node) -> object:
    """The ``dropout_p`` a call passes (an attention's, ours absorbed or torch's), or 0."""
    if "dropout_p" in node.kwargs:
        return node.kwargs["dropout_p"]
    try:
        bound = inspect.signature(node.target).bind_partial(*node.args, **node.kwargs)
    except (TypeError, ValueError):  # a builtin without a signature: torch's attention
        name = getattr(node.target, "__name__", "")
        if name == "scaled_dot_product_attention" and len(node.args) > 4:
            return node.args[4]
        return 0.0
    return bound.arguments.get("dropout_p", 0.0)


def decompositions(fallback_random: bool = True) -> dict:
    """Inductor's decomposition table (which depends on ``fallback_random``) with
    :func:`native_dropout` in it."""
    import torch._inductor.config as inductor_config
    from torch._inductor.decomposition import select_decomp_table

    with inductor_config.patch(fallback_random=fallback_random):
        table = dict(select_decomp_table())
    table[aten.native_dropout.default] = native_dropout
    return table


class DropoutTag(CustomGraphPass):
    """Changes nothing; its uuid (this file's hash) keys the caches to this dropout."""

    def __call__(self, graph: fx.Graph) -> None:
        pass

    def uuid(self) -> bytes:
        return hashlib.sha256(Path(__file__).read_bytes()).digest()
