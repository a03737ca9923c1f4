"""Thin products that read the same activation, computed as one (compiled graphs).

A transformer block multiplies one activation by several thin factors: CoLA's Q, K and
V layers each start with ``x @ U`` (ranks of 20-100 against widths of 384-1024), and so do
the MLP's gate and up projections. MKL runs a product with a narrow right-hand side well
below its peak, and in backward each adds its own input-gradient product and a sum of
those. Concatenated, ``x @ [U_q | U_k | U_v]`` is one wider product: forward one matmul,
backward one input-gradient product (no sum) and one weight-gradient product, and the
outputs are column slices that the pointwise ops after them (silu, the gate) read in
place. The concatenation copies the factors, not the activations (``python
benchmarks/kernels.py``, sibling products section, times both forms; ``python
benchmarks/compiled.py`` the steps).

:func:`fuse_sibling_matmuls` rewrites a dynamo graph before AOT autograd, so the fused
backward comes from differentiating the fused forward. It joins ``a @ b_1``, ..., ``a @
b_n`` (the same ``a``; each ``b_i`` 2-D, at most ``MAX_WIDTH`` columns, computed from the
graph's inputs by views and casts only: a weight, not an activation) into ``a @ cat(b_i)``
split back by columns. The sum is the same up to float rounding (another blocking inside
the kernel).
"""

from __future__ import annotations

import logging
import operator
from collections import defaultdict

import torch
from torch import fx

log = logging.getLogger("comera_compile")

MAX_WIDTH = 256
"""The widest right-hand side joined: thin products are where MKL loses most (a rank-wide
``b``); a layer's full width already runs near peak and gains little from joining."""

_MATMULS = (operator.matmul, torch.matmul)
_VIEW_METHODS = {"reshape", "view", "to", "contiguous", "t", "float", "half", "bfloat16",
                 "type_as", "__getitem__"}
_VIEW_FUNCTIONS = {torch.reshape, torch.t, operator.getitem, torch.Tensor.to}
_fused = 0


def fuse_sibling_matmuls(gm: fx.GraphModule) -> int:
    """Join the thin products of ``gm`` that share their left operand (module docstring);
    returns how many products were joined into others (a group of three counts two)."""
    global _fused
    groups: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        if _thin_weight_product(node):
            groups[_source(node.args[0])].append(node)
    joined = 0
    for members in groups.values():  # one left operand: equal rows, dtype and device
        if len(members) < 2:
            continue
        _join(gm.graph, members, {node: i for i, node in enumerate(gm.graph.nodes)})
        joined += len(members) - 1
    if joined:
        _fused += joined
        gm.graph.lint()
        gm.recompile()
        log.info("comera backend: %d thin product(s) joined with a sibling reading the same "
                 "activation", joined)
    return joined


def products_joined() -> int:
    """How many products this process's compiled graphs joined into a sibling's."""
    return _fused


def _value(node: object):
    return node.meta.get("example_value") if isinstance(node, fx.Node) else None


def _source(node: fx.Node) -> fx.Node:
    """``node`` with casts that change nothing looked through: each layer casts its input
    to its own dtype (``x.to(dtype)``), a no-op that makes a new node per layer."""
    while (node.op == "call_method" and node.target == "to" and node.args
           and isinstance(node.args[0], fx.Node)):
        before, after = _value(node.args[0]), _value(node)
        if not (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor)):
            break
        if (before.dtype, before.device, before.shape) != (after.dtype, after.device,
                                                           after.shape):
            break
        node = node.args[0]
    return node


def _thin_weight_product(node: fx.Node) -> bool:
    """``a @ b`` with ``b`` a 2-D weight (``_weight_chain``) of at most MAX_WIDTH columns."""
    if node.op != "call_function" or node.target not in _MATMULS or node.kwargs:
        return False
    if len(node.args) != 2 or not all(isinstance(a, fx.Node) for a in node.args):
        return False
    a, b = (_value(n) for n in node.args)
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if a.dim() < 2 or b.dim() != 2 or a.dtype != b.dtype or a.device != b.device:
        return False
    width = b.shape[1]  # a symbolic width is a rank kept symbolic (compile.rank_dims): thin
    if isinstance(width, int) and width > MAX_WIDTH:
        return False
    return _weight_chain(node.args[1]) is not None


def _weight_chain(node: fx.Node) -> list[fx.Node] | None:
    """The nodes that compute ``node`` from the graph's inputs, if they are views and
    casts only (a weight read, not an activation computed); None otherwise."""
    chain, stack, seen = [], [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op in ("placeholder", "get_attr"):
            continue
        if n.op == "call_method" and n.target in _VIEW_METHODS:
            pass
        elif n.op == "call_function" and n.target in _VIEW_FUNCTIONS:
            pass
        else:
            return None
        chain.append(n)
        stack.extend(n.all_input_nodes)
    return chain


def _join(graph: fx.Graph, members: list[fx.Node], order: dict[fx.Node, int]) -> None:
    """Replace ``members`` (``a @ b_i``) by one product and a split, at the first member;
    the weights' view chains that come later in the graph move up to it."""
    first = min(members, key=order.__getitem__)
    late = {n for m in members for n in _weight_chain(m.args[1]) if order[n] > order[first]}
    for node in sorted(late, key=order.__getitem__):
        first.prepend(node)
    weights = [m.args[1] for m in members]
    with graph.inserting_before(first):
        widths = [w.meta["example_value"].shape[1] for w in weights]
        sizes = [s if isinstance(s, int) else graph.call_method("size", (w, 1))
                 for s, w in zip(widths, weights)]
        joined = graph.call_function(torch.cat, (weights, 1))
        product = graph.call_function(operator.matmul, (_source(first.args[0]), joined))
        parts = graph.call_function(torch.split, (product, sizes), {"dim": -1})
        for i, member in enumerate(members):
            part = graph.call_function(operator.getitem, (parts, i))
            part.meta.update(member.meta)
            member.replace_all_uses_with(part)
    for member in members:
        graph.erase_node(member)
