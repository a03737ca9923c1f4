"""What a low activation budget recomputes in backward, and what it must keep."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.checkpoint import CheckpointPolicy

from comera_compile.compile.graph.graph_nodes import call_with_value
from comera_compile.planner.ops import symbolic_hint

THIN = 48  # a matmul contracting at most this many indices is cheap to redo (TT bonds)

aten = torch.ops.aten
_MATMULS = {aten.mm.default: 0, aten.addmm.default: 1, aten.bmm.default: 0}  # -> left operand
_LAYOUT_OPS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default,
               aten.permute.default, aten.transpose.int, aten.t.default, aten.expand.default,
               aten.unsqueeze.default, aten.squeeze.dim, aten.slice.Tensor, aten.clone.default}
SMALL = 1 << 20  # bytes: an input this small (a bias, a scale) is kept whatever it costs
WIDE = 4 << 20  # bytes: a thin product this large is worth remaking; a smaller one is kept


def _nbytes(node: fx.Node) -> int:
    """Bytes of a node's value; a symbolic size counts at its hint, read without a guard
    (a guard would pin the graph to one batch size)."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return 0
    numel = value.numel()
    if isinstance(numel, torch.SymInt):
        try:
            numel = symbolic_hint(numel)
        except Exception:  # an unbacked size has no hint: not small
            return WIDE
    return int(numel) * value.element_size()


def _backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes of a joint graph that read the tangents (the backward part)."""
    backward = {n for n in graph.nodes if n.op == "placeholder" and "tangents" in n.name}
    for node in graph.nodes:
        if any(a in backward for a in node.all_input_nodes):
            backward.add(node)
    return backward


def _thin(node: fx.Node) -> bool:
    left = node.args[_MATMULS[node.target]]
    value = left.meta.get("val") if isinstance(left, fx.Node) else None
    k = value.shape[-1] if isinstance(value, torch.Tensor) else None
    return isinstance(k, int) and k <= THIN


def recompute_thin_products(graph: fx.Graph) -> int:
    """Mark a joint graph's thin matmul outputs, and pointwise ops computed from them alone,
    ``MUST_RECOMPUTE``; returns how many nodes were marked. Nodes already marked (the
    random values) are left as they are."""
    backward = _backward_nodes(graph)
    thin: set[fx.Node] = set()
    for node in graph.nodes:
        if node in backward or node.op != "call_function" or "recompute" in node.meta:
            continue
        if node.target in _MATMULS:
            if _thin(node) and _nbytes(node) >= WIDE:
                thin.add(node)
            continue
        pointwise = node.target in _LAYOUT_OPS or torch.Tag.pointwise in getattr(
            node.target, "tags", ())
        inputs = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        if pointwise and any(a in thin for a in inputs) and all(
            a in thin or _nbytes(a) < SMALL
            or a.meta.get("recompute") == CheckpointPolicy.MUST_SAVE for a in inputs
        ):
            thin.add(node)
    for node in thin:
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    return len(thin)


def _read_by_backward(node: fx.Node, backward: set[fx.Node]) -> bool:
    """Whether backward reads ``node``, directly or through layout ops (views, transposes)."""
    todo, seen = [node], set()
    while todo:
        current = todo.pop()
        for user in current.users:
            if user in backward:
                return True
            if user.op == "call_function" and user.target in _LAYOUT_OPS and user not in seen:
                seen.add(user)
                todo.append(user)
    return False


def recompute_masks(graph: fx.Graph, keep_memory: bool = False) -> int:
    """Mark a joint graph's forward comparison masks that backward reads ``MUST_RECOMPUTE``;
    with ``keep_memory``, only those whose every input is small or read by backward anyway.
    Returns how many were marked. Masks already marked (random ones) are left as they are."""
    backward = _backward_nodes(graph)
    count = 0
    for node in graph.nodes:
        value = node.meta.get("val")
        if (node in backward or node.op != "call_function" or "recompute" in node.meta
                or not isinstance(value, torch.Tensor) or value.dtype != torch.bool
                or torch.Tag.pointwise not in getattr(node.target, "tags", ())
                or not any(user in backward for user in node.users)):
            continue
        inputs = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        if not keep_memory or all(
            _nbytes(a) < SMALL or _read_by_backward(a, backward) for a in inputs
        ):
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            count += 1
    return count


def is_random(node: fx.Node) -> bool:
    """Whether ``node`` draws from a random generator (dropout, rand_like, bernoulli, ...)."""
    tags = getattr(node.target, "tags", ())
    return node.op == "call_function" and torch.Tag.nondeterministic_seeded in tags


def save_random_values(graph: fx.Graph) -> int:
    """Mark a joint graph's random values (random nodes, and nodes computed from them and fixed
    values alone); returns how many were marked saved. Values drawn from keys (random nodes
    under :data:`SMALL` bytes, as ``compile.cpu.dropout`` draws) keep their keys and are
    recomputed; values drawn per element are saved where something else reads them (then
    kept as bits by :func:`pack_saved_masks`)."""
    fixed: set[fx.Node] = set()  # computed from no graph input: constants, an arange
    derived: set[fx.Node] = set()  # computed from random draws and fixed values only
    keyed: set[fx.Node] = set()  # ... from small random draws (keys) and fixed values only
    for node in graph.nodes:
        inputs = node.all_input_nodes
        if node.op == "get_attr" or (node.op == "call_function" and not is_random(node)
                                     and all(a in fixed for a in inputs)):
            fixed.add(node)
            continue
        pure = node.op == "call_function" and all(a in derived or a in fixed for a in inputs)
        if pure and (is_random(node) or any(a in derived for a in inputs)):
            derived.add(node)
            if (is_random(node) and _nbytes(node) < SMALL) or (
                not is_random(node) and all(a in keyed or a in fixed for a in inputs)
            ):
                keyed.add(node)
    count = 0
    for node in graph.nodes:
        read_elsewhere = any(user not in derived for user in node.users)
        if node in keyed and not is_random(node):
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        elif (node in keyed or (node in derived and read_elsewhere)
              or (is_random(node) and node not in derived)):
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            count += 1
    return count


BITS = 8


def _packable(node: fx.Node) -> bool:
    value = node.meta.get("val")
    return (node.meta.get("recompute") == CheckpointPolicy.MUST_SAVE
            and isinstance(value, FakeTensor) and value.dtype == torch.bool
            and value.is_contiguous() and all(isinstance(d, int) for d in value.shape)
            and value.numel() >= 64)


def pack_saved_masks(graph: fx.Graph) -> int:
    """Keep each saved boolean mask of a joint graph as bits; returns how many. ``mask``
    becomes a packed byte per eight elements (saved) and an unpacking (recomputed) its
    readers read instead. Masks of symbolic shape stay bytes."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    count = 0
    for mask in [n for n in graph.nodes if _packable(n)]:
        value, readers = mask.meta["val"], list(mask.users)
        mode, numel, groups = value.fake_mode, value.numel(), -(-value.numel() // BITS)
        with graph.inserting_before(min(readers, key=order.__getitem__)):
            shifts = call_with_value(graph, mode, torch.ops.prims.iota.default, BITS, start=0,
                                     step=1, dtype=torch.uint8, device=value.device,
                                     requires_grad=False)
            packed = mask
            for target, *args in ((aten.view.default, [numel]),
                                  (aten.constant_pad_nd.default, [0, groups * BITS - numel]),
                                  (aten.view.default, [groups, BITS]),
                                  (torch.ops.prims.convert_element_type.default, torch.uint8),
                                  (aten.bitwise_left_shift.Tensor, shifts),
                                  (aten.sum.dim_IntList, [1])):
                kwargs = {"dtype": torch.uint8} if target is aten.sum.dim_IntList else {}
                packed = call_with_value(graph, mode, target, packed, *args, **kwargs)
            unpacked = [call_with_value(graph, mode, aten.unsqueeze.default, packed, 1)]
            for target, *args in ((aten.bitwise_right_shift.Tensor, shifts),
                                  (aten.bitwise_and.Scalar, 1),
                                  (aten.view.default, [groups * BITS]),
                                  (aten.slice.Tensor, 0, 0, numel),
                                  (aten.view.default, list(value.shape)), (aten.ne.Scalar, 0)):
                unpacked.append(call_with_value(graph, mode, target, unpacked[-1], *args))
        for reader in readers:
            reader.replace_input_with(mask, unpacked[-1])
        del mask.meta["recompute"]
        packed.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        for node in (shifts, *unpacked):
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        count += 1
    return count


class SaveRandomValues(CustomGraphPass):
    """Inductor's ``joint_custom_pre_pass``: :func:`save_random_values`; with ``cpu``,
    :func:`recompute_masks`; with ``low_memory``, then :func:`pack_saved_masks` and
    :func:`recompute_thin_products`."""

    def __init__(self, low_memory: bool = True, cpu: bool = False) -> None:
        self.low_memory, self.cpu = low_memory, cpu

    def __call__(self, graph: fx.Graph) -> None:
        save_random_values(graph)
        if self.cpu:
            recompute_masks(graph, keep_memory=self.low_memory)
        if self.low_memory:
            pack_saved_masks(graph)
            recompute_thin_products(graph)

    def uuid(self) -> bytes:  # part of inductor's cache key: changes with this file
        settings = (THIN, SMALL, WIDE, self.low_memory, self.cpu)  # and with the settings
        sizes = repr(settings).encode()
        return hashlib.sha256(Path(__file__).read_bytes() + sizes).digest()


def partition_keeping_random(joint: fx.GraphModule, joint_inputs, **kwargs):
    """The min-cut partitioner after :func:`save_random_values` (for the non-inductor path)."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    save_random_values(joint.graph)
    pack_saved_masks(joint.graph)
    recompute_thin_products(joint.graph)
    joint.recompile()
    return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
