"""Nodes that graph passes insert into AOT autograd's and inductor's graphs."""

from __future__ import annotations

from typing import Any

from torch import fx


def call_with_value(graph: fx.Graph, fake_mode: Any, target: Any, *args: Any,
                    **kwargs: Any) -> fx.Node:
    """Insert ``target(*args, **kwargs)`` at the graph's insert point, with its fake value
    computed from its inputs' under ``fake_mode``."""
    node = graph.call_function(target, args, kwargs)
    with fake_mode:
        node.meta["val"] = target(*fx.node.map_arg(args, lambda n: n.meta["val"]), **kwargs)
    return node
