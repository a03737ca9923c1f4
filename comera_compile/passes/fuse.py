"""Horizontal fusion: sibling Linear layers that read the same input become one layer."""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx
import torch
from torch import fx, nn


@dataclass(frozen=True)
class FusedGroup:
    """Linear layers ``members`` (qualified names) now computed by the layer ``name``;
    member ``k`` owns output columns ``[offsets[k], offsets[k + 1])``."""

    name: str
    members: tuple[str, ...]
    offsets: tuple[int, ...]


def graph_of(gm: fx.GraphModule) -> nx.DiGraph:
    """The fx graph as a networkx DiGraph over nodes (an edge: producer -> user)."""
    graph = nx.DiGraph()
    for node in gm.graph.nodes:
        graph.add_node(node)
        for user in node.users:
            graph.add_edge(node, user)
    return graph


def _linear(gm: fx.GraphModule, node: fx.Node) -> nn.Linear | None:
    if node.op != "call_module":
        return None
    module = gm.get_submodule(node.target)
    return module if type(module) is nn.Linear else None


def _signature(linear: nn.Linear) -> tuple:
    w = linear.weight
    return linear.in_features, linear.bias is not None, w.dtype, w.device


def sibling_groups(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """Groups of >= 2 fusable Linear calls that read the same node, in graph order."""
    graph = graph_of(gm)
    calls: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
    modules: dict[int, int] = {}  # one module under two names is shared: leave it alone
    for _, module in gm.named_modules(remove_duplicate=False):
        modules[id(module)] = modules.get(id(module), 0) + 1
    order = {node: k for k, node in enumerate(gm.graph.nodes)}
    groups = []
    for source in gm.graph.nodes:
        by_kind: dict[tuple, list[fx.Node]] = {}
        for user in graph.successors(source):
            linear = _linear(gm, user)
            if (
                linear is None
                or user.args != (source,)
                or user.kwargs
                or calls[user.target] != 1
                or modules[id(linear)] != 1
            ):
                continue
            by_kind.setdefault(_signature(linear), []).append(user)
        groups += [sorted(g, key=order.get) for g in by_kind.values() if len(g) > 1]
    return groups


def _fused_name(gm: fx.GraphModule, targets: list[str]) -> str:
    parents = {t.rpartition(".")[0] for t in targets}
    parent = parents.pop() if len(parents) == 1 else ""
    leaf = "_".join(t.rpartition(".")[2] for t in targets)
    name = f"{parent}.{leaf}" if parent else leaf
    base, k = name, 1
    while _exists(gm, name):
        name, k = f"{base}_{k}", k + 1
    return name


def _exists(gm: fx.GraphModule, name: str) -> bool:
    try:
        gm.get_submodule(name)
    except AttributeError:
        return False
    return True


@torch.no_grad()
def fuse_linear_siblings(gm: fx.GraphModule) -> list[FusedGroup]:
    """Fuse every group of sibling Linear layers of ``gm`` in place; what was fused."""
    fused = []
    for group in sibling_groups(gm):
        targets = [node.target for node in group]
        linears = [gm.get_submodule(t) for t in targets]
        first = linears[0]
        outs = [lin.out_features for lin in linears]
        layer = nn.Linear(first.in_features, sum(outs), bias=first.bias is not None,
                          device=first.weight.device, dtype=first.weight.dtype)
        layer.weight.copy_(torch.cat([lin.weight for lin in linears]))
        if layer.bias is not None:
            layer.bias.copy_(torch.cat([lin.bias for lin in linears]))
        layer.train(first.training)
        name = _fused_name(gm, targets)
        gm.add_submodule(name, layer)
        offsets = [0]
        for out in outs:
            offsets.append(offsets[-1] + out)
        with gm.graph.inserting_before(group[0]):
            call = gm.graph.call_module(name, group[0].args)
        for node, start, out in zip(group, offsets, outs):
            with gm.graph.inserting_after(call):
                part = gm.graph.call_function(torch.narrow, (call, -1, start, out))
            node.replace_all_uses_with(part)
            gm.graph.erase_node(node)
        for target in targets:
            gm.delete_submodule(target)
        fused.append(FusedGroup(name, tuple(targets), tuple(offsets)))
    gm.graph.lint()
    gm.recompile()
    return fused


def fuse_captured(captured) -> list[FusedGroup]:
    """Fuse the siblings of a :class:`~comera_compile.passes.capture.Capture` on the fx path,
    keeping its record of called modules in step with the new names."""
    if not isinstance(captured.model, fx.GraphModule):
        raise ValueError("fusing sibling layers needs a model that torch.fx can trace "
                         f"({captured.reason or captured.path}); pass fuse=False")
    fused = fuse_linear_siblings(captured.model)
    if captured.called is not None:
        for group in fused:
            captured.called.difference_update(group.members)
            captured.called.add(group.name)
    return fused
