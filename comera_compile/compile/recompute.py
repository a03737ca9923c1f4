"""Keep random values out of backward recomputation.

With an activation memory budget below 1 (``memory="low"``), AOT autograd's min-cut
partitioner may lift its own ban on recomputing random ops (dropout) to meet the budget.
On CPU nothing replays the random stream, so the backward would draw a *new* dropout mask
and compute gradients of a forward that never ran. Marking the random values ``MUST_SAVE``
in the joint graph, before partitioning, keeps each dropout mask (one byte per element)
and lets the budget recompute everything around it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.utils.checkpoint import CheckpointPolicy


def is_random(node: fx.Node) -> bool:
    """Whether ``node`` draws from a random generator (dropout, rand_like, bernoulli, ...)."""
    tags = getattr(node.target, "tags", ())
    return node.op == "call_function" and torch.Tag.nondeterministic_seeded in tags


def _fixed(node: fx.Node) -> bool:
    """A value that depends on no input of the graph (a fresh buffer, a constant)."""
    return node.op == "get_attr" or (node.op == "call_function" and not node.all_input_nodes)


def save_random_values(graph: fx.Graph) -> int:
    """Mark a joint graph's random values as saved for backward; returns how many.

    A random value is a random node, or a node computed from random draws alone (the
    boolean mask that ``compile.dropout`` derives from 64-bit words). What is marked is
    each such value that something else reads, i.e. the mask rather than the words it came
    from: the smallest form, and the draws themselves are then never needed again."""
    derived: set[fx.Node] = set()  # computed from random draws and fixed values only
    for node in graph.nodes:
        inputs = node.all_input_nodes
        pure = node.op == "call_function" and all(a in derived or _fixed(a) for a in inputs)
        if pure and (is_random(node) or any(a in derived for a in inputs)):
            derived.add(node)
    count = 0
    for node in graph.nodes:
        read_elsewhere = any(user not in derived for user in node.users)
        if (node in derived and read_elsewhere) or (is_random(node) and node not in derived):
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            count += 1
    return count


class SaveRandomValues(CustomGraphPass):
    """:func:`save_random_values` as inductor's ``joint_custom_pre_pass``."""

    def __call__(self, graph: fx.Graph) -> None:
        save_random_values(graph)

    def uuid(self) -> bytes:  # part of inductor's cache key: changes with this file
        return hashlib.sha256(Path(__file__).read_bytes()).digest()


def partition_keeping_random(joint: fx.GraphModule, joint_inputs, **kwargs):
    """The min-cut partitioner after :func:`save_random_values` (for the non-inductor path)."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    save_random_values(joint.graph)
    return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
