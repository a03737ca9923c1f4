"""Drop dead rank channels during training, optimizer state included.

``prune_ranks`` shrinks each core and gate in place (same Parameter objects, smaller
``.data``). The optimizer keeps per-parameter state (AdamW's ``exp_avg``, ``exp_avg_sq``,
``max_exp_avg_sq``) in the old shape, so we slice it exactly as the parameters were
sliced. Training then goes on as if the channels had never existed, and every later step
is cheaper. Scalar state such as ``step`` is left alone.

Under ``torch.compile`` a prune changes parameter shapes, so the model recompiles once per
prune that removed something; nothing else changes shapes between prunes.
"""

from __future__ import annotations

import torch
from torch import nn

from comera_compile.nn import PruneResult, tensorized_layers


def slice_optimizer_state(
    optimizer: torch.optim.Optimizer,
    result: PruneResult,
    shapes_before: dict[int, torch.Size],
) -> None:
    """Replay ``result.slices`` on the optimizer state: at each slice, every state tensor
    whose shape matches the parameter's shape just before that slice is cut the same way."""
    shapes = {key: list(shape) for key, shape in shapes_before.items()}
    for param, dim, index in result.slices:
        old = shapes[id(param)]
        state = optimizer.state.get(param, {})
        for name, value in state.items():
            if torch.is_tensor(value) and list(value.shape) == old:
                state[name] = value.index_select(dim, index.to(value.device))
        old[dim] = index.numel()


@torch.no_grad()
def prune_model(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, PruneResult]:
    """``prune_ranks`` on every tensorized layer, slicing the optimizer's state to match.

    Returns the results of the layers that lost channels, by module name. Layers drop their
    cached contraction plans themselves, so the next forward plans for the new ranks.
    """
    results = {}
    for name, layer in tensorized_layers(model).items():
        params = [*layer.cores, *layer.gates]
        shapes_before = {id(p): p.shape for p in params}
        result = layer.prune_ranks()
        if not result:
            continue
        if optimizer is not None:
            slice_optimizer_state(optimizer, result, shapes_before)
        results[name] = result
    return results


@torch.no_grad()
def keep_min_rank(model: nn.Module, min_rank: int = 1) -> int:
    """Hold the ``min_rank`` largest gate entries of every bond above the threshold.

    A bond with no live channel zeroes its whole layer (the chain has a zero matrix in the
    middle), and a dead gate gets no gradient to come back: the rank penalty must shrink
    layers, never silently switch them off. Returns how many entries were lifted.
    """
    lifted = 0
    for layer in tensorized_layers(model).values():
        floor = 2 * layer.threshold
        for gate in layer.gates:
            k = min(min_rank, gate.numel())
            top = gate.abs().topk(k).indices
            low = top[gate[top].abs() <= layer.threshold]
            if low.numel():
                sign = torch.where(gate[low] < 0, -1.0, 1.0).to(gate.dtype)
                gate[low] = sign * floor
                lifted += low.numel()
    return lifted
