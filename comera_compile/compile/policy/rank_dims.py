"""Rank dimensions symbolic in compiled graphs: one graph serves every rank a layer takes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from comera_compile.nn import TTLinear, TTMLinear

SYMBOLIC_LAYERS = (TTLinear, TTMLinear)
"""Layers whose forward is one planned contraction (``planner.ops.planned_contract``), which
runs at any bond size; ``LowRankLinear`` is a ``TTLinear``."""


def symbolic_layers(model: nn.Module) -> list[nn.Module]:
    """The layers of ``model`` whose bonds a compiled graph keeps symbolic."""
    return [m for m in model.modules() if isinstance(m, SYMBOLIC_LAYERS)]


def bond_dims(layer: nn.Module) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
    """Each core and gate of ``layer`` with its bond dims (a core ``(r_{k-1}, ..., r_k)``
    has two, the chain's ends one; a gate its only one)."""
    last = len(layer.cores) - 1
    out = [(core, tuple(d for d, inner in ((0, k > 0), (core.dim() - 1, k < last)) if inner))
           for k, core in enumerate(layer.cores)]
    return out + [(gate, (0,)) for gate in layer.gates]


def mark_bonds(layer: nn.Module) -> None:
    """Mark the bond dims of ``layer``'s cores and gates dynamic (dynamo's hint, honoured
    where parameters may be symbolic: :func:`symbolic_parameters`)."""
    for tensor, dims in bond_dims(layer):
        for dim in dims:
            torch._dynamo.maybe_mark_dynamic(tensor, dim)


def _marked(layer: nn.Module) -> bool:
    return not layer.gates or hasattr(layer.gates[0], "_dynamo_weak_dynamic_indices")


@contextlib.contextmanager
def symbolic_parameters() -> Iterator[None]:
    """Trace with parameters' marked dims symbolic (dynamo keeps parameters static
    otherwise, and every tensor of a module inside one of torch's own, such as
    ``nn.TransformerEncoderLayer``) and without duck sizing (a bond equal in size to
    another dim would share its symbol, and a cut that parts them would compile again)."""
    import torch.fx.experimental._config as fx_config

    with torch._dynamo.config.patch(force_parameter_static_shapes=False,
                                    force_nn_module_property_static_shapes=False), \
            fx_config.patch(use_duck_shape=False):
        yield


class SymbolicRanks:
    """A compiled call of ``model`` whose graphs keep the planned layers' ranks symbolic
    while ``enabled`` (set it before the first call): each call marks bonds that are not
    marked yet (new or replaced parameters), then runs ``compiled`` with symbolic
    parameters allowed. Disabled, it runs ``compiled`` as it is (static ranks)."""

    def __init__(self, model: nn.Module, compiled: Callable[..., Any],
                 enabled: bool = True) -> None:
        self.compiled, self.enabled = compiled, enabled
        self.layers = symbolic_layers(model)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.enabled:
            return self.compiled(*args, **kwargs)
        for layer in self.layers:
            if not _marked(layer):
                mark_bonds(layer)
        with symbolic_parameters():
            return self.compiled(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # the wrapped call's own API (describe, ...)
        try:
            compiled = self.__dict__["compiled"]
        except KeyError:  # while copying, before __init__'s fields exist
            raise AttributeError(name) from None
        return getattr(compiled, name)
