"""Thin products that read the same activation, computed as one (compiled graphs)."""

from __future__ import annotations

import logging
import operator
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import fx

from comera_compile.planner.ops import CONTRACT, symbolic_hint

log = logging.getLogger("comera_compile")

MAX_WIDTH = 256
"""The widest right-hand side joined: thin products are where MKL loses most (a rank-wide
``b``); a layer's full width already runs near peak and gains little from joining."""

_MATMULS = (operator.matmul, torch.matmul)
_VIEW_METHODS = {"reshape", "view", "to", "contiguous", "t", "float", "half", "bfloat16",
                 "type_as", "__getitem__"}
_VIEW_FUNCTIONS = {torch.reshape, torch.t, operator.getitem, torch.Tensor.to}
# a gated or padded core is still a weight: the rank gate (``core * hardshrink(gate)``)
# and the bond padding (``planner.alignment``) read parameters only, and a reshape to a
# symbolic rank (``compile.policy.rank_dims``) builds its ``torch.Size`` from the rank's symbol
_WEIGHT_FUNCTIONS = {operator.mul, torch.mul, torch.hardshrink, F.pad, torch._C._nn.pad,
                     torch.Size}
_WEIGHT_METHODS = {"mul", "hardshrink"}
_fused = 0


def fuse_sibling_matmuls(gm: fx.GraphModule) -> int:
    """Join the thin products of ``gm`` that share their left operand (module docstring);
    returns how many products were joined into others (a group of three counts two)."""
    global _fused
    joined = _join_lowrank_siblings(gm.graph)
    groups: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        if _thin_weight_product(node):
            groups[_source(node.args[0])].append(node)
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
    width = b.shape[1]  # a symbolic width is a rank kept symbolic (compile.policy.rank_dims): thin
    if isinstance(width, int) and width > MAX_WIDTH:
        return False
    return _weight_chain(node.args[1]) is not None


def _weight_chain(node: fx.Node) -> list[fx.Node] | None:
    """The nodes that compute ``node`` from the graph's inputs, if they are views, casts
    and the rank gate's or the bond padding's arithmetic only (a weight read, not an
    activation computed); None otherwise."""
    chain, stack, seen = [], [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op in ("placeholder", "get_attr"):
            continue
        if n.op == "call_method" and n.target in _VIEW_METHODS | _WEIGHT_METHODS:
            pass
        elif n.op == "call_function" and n.target in _VIEW_FUNCTIONS | _WEIGHT_FUNCTIONS:
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


def _join_lowrank_siblings(graph: fx.Graph) -> int:
    """Write out the planned low-rank contractions that read one activation as ``x @ U_i @
    V_i`` and join their ``x @ U_i`` (module docstring); returns how many were joined."""
    groups: dict[tuple, list[fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        key = _lowrank_sibling_key(node)
        if key is not None:
            groups[key].append(node)
    joined = 0
    for members in groups.values():
        if len(members) < 2:
            continue
        x = members[0].args[0]  # the first member's reshape of the activation: defined
        firsts = []             # before every member, equal to each member's own
        for member in members:
            u, v = member.args[1]
            with graph.inserting_before(member):
                first = graph.call_function(operator.matmul, (x, u))
                product = graph.call_function(operator.matmul, (first, v))
            product.meta.update(member.meta)
            member.replace_all_uses_with(product)
            own_x = member.args[0]
            graph.erase_node(member)
            _erase_unused_views(graph, own_x)
            firsts.append(first)
        _join(graph, firsts, {node: i for i, node in enumerate(graph.nodes)})
        joined += len(members) - 1
    return joined


def _lowrank_sibling_key(node: fx.Node) -> tuple | None:
    """For a planned low-rank contraction ``x @ U @ V`` whose plan starts from ``x @ U`` and
    whose ``U`` is a thin weight: its activation (the base of ``x``'s reshapes) with ``x``'s
    shape and dtype, which its siblings share. None for any other node."""
    if node.op != "call_function" or node.target is not CONTRACT:
        return None
    x, cores, kind, *_, autotune = node.args
    if kind != "lowrank" or autotune or not isinstance(x, fx.Node) or len(cores) != 2:
        return None
    if not all(isinstance(c, fx.Node) for c in cores):
        return None
    xv, uv, vv = _value(x), _value(cores[0]), _value(cores[1])
    if not all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in (xv, uv, vv)):
        return None
    if xv.dtype != uv.dtype or uv.dtype != vv.dtype:
        return None
    try:  # sizes read through their hints: no guard on a symbolic batch or rank
        rows, n_in, rank, n_out = (symbolic_hint(s) for s in (*xv.shape, *vv.shape))
    except Exception:  # an unbacked size: leave the op to its plan
        return None
    if isinstance(uv.shape[1], int) and uv.shape[1] > MAX_WIDTH:
        return None
    if rows * rank * (n_in + n_out) > n_in * n_out * (rank + rows):
        return None  # the plan would build U @ V first: not a thin product of x
    if _weight_chain(cores[0]) is None:
        return None
    return (_base(x), tuple(str(s) for s in xv.shape), xv.dtype)


def _base(node: fx.Node) -> fx.Node:
    """The tensor ``node`` reshapes: each layer reshapes the activation it reads itself
    (``x.reshape(-1, n)``), and reshapes of one tensor to one shape hold equal values."""
    while True:
        node = _source(node)
        if (node.op == "call_method" and node.target in ("reshape", "view")
                or node.op == "call_function" and node.target is torch.reshape) \
                and isinstance(node.args[0], fx.Node):
            node = node.args[0]
        else:
            return node


def _erase_unused_views(graph: fx.Graph, node: fx.Node) -> None:
    """Erase ``node`` and the reshapes and casts under it that nothing reads any more."""
    while (node.op in ("call_method", "call_function") and not node.users
           and (node.target in _VIEW_METHODS or node.target in _VIEW_FUNCTIONS)):
        below = node.args[0] if node.args else None
        graph.erase_node(node)
        if not isinstance(below, fx.Node):
            return
        node = below
