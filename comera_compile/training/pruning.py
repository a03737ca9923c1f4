"""Drop dead rank channels during training, optimizer state included: state laid out like
the parameter is sliced with it; state of any other shape is reset, with a warning."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from comera_compile.nn import PruneResult, TensorizedLayer, tensorized_layers
from comera_compile.training.bank import GateBank, full


def _follows(shape: torch.Size, param_shape: list[int]) -> bool:
    """A state tensor laid out like the parameter: same dimensions, each size the
    parameter's or 1 (broadcast, as Adafactor's factored row and column variances)."""
    return len(shape) == len(param_shape) and all(
        s == p or s == 1 for s, p in zip(shape, param_shape)
    )


def slice_optimizer_state(optimizer: torch.optim.Optimizer, result: PruneResult,
                          shapes_before: dict[int, torch.Size]) -> None:
    """Replay ``result.slices`` on the optimizer state: at each slice, every state tensor
    laid out like the parameter (shape just before that slice) and spanning the pruned
    dimension is cut the same way; scalars and tensors broadcast along it are kept. A
    parameter with any other state tensor has its state reset, with a warning."""
    shapes = {key: list(shape) for key, shape in shapes_before.items()}
    for param, dim, index in result.slices:
        old = shapes[id(param)]
        state = optimizer.state.get(param, {})
        odd = [name
               for name, value in state.items()
               if torch.is_tensor(value) and value.numel() > 1 and not _follows(value.shape, old)]
        if odd:
            _reset_state(optimizer, param, odd, old)
            state = {}
        for name, value in state.items():
            if torch.is_tensor(value) and value.numel() > 1 and value.shape[dim] == old[dim]:
                state[name] = value.index_select(dim, index.to(value.device))
        old[dim] = index.numel()


def _reset_state(optimizer: torch.optim.Optimizer, param: torch.Tensor, names: list[str],
                 shape: list[int]) -> None:
    shapes = ", ".join(f"'{n}' {list(optimizer.state[param][n].shape)}" for n in names)
    warnings.warn(
        f"{type(optimizer).__name__} state {shapes} of a parameter of shape {shape} is not "
        "laid out along the parameter's dimensions, so it cannot be cut with the pruned "
        "channels; that parameter's optimizer state was reset (started afresh at the next "
        "step). Give such state the parameter's shape (or size 1 where it is shared) to "
        "keep it across prunes",
        stacklevel=4,
    )
    del optimizer.state[param]


@torch.no_grad()
def prune_model(model: nn.Module,
                optimizer: torch.optim.Optimizer | None = None) -> dict[str, PruneResult]:
    """``prune_ranks`` on every tensorized layer, slicing the optimizer's state to match.

    Returns the results of the layers that lost channels, by module name."""
    results = {}
    for name, layer in tensorized_layers(model).items():
        result = prune_layer(layer, optimizer)
        if result:
            results[name] = result
    return results


@torch.no_grad()
def prune_layer(layer: TensorizedLayer,
                optimizer: torch.optim.Optimizer | None = None) -> PruneResult:
    """``layer.prune_ranks()`` with the optimizer's state sliced to match."""
    shapes_before = {id(p): p.shape for p in (*layer.cores, *layer.gates)}
    result = layer.prune_ranks()
    if result and optimizer is not None:
        slice_optimizer_state(optimizer, result, shapes_before)
    return result


@torch.no_grad()
def keep_min_rank(model: nn.Module, min_rank: int = 1) -> int:
    """Hold the ``min_rank`` largest gate entries of every bond above the threshold."""
    bank = GateBank(model)
    if not len(bank):
        return 0
    counts = [int(c) for c in bank.alive_counts().tolist()]
    return lift_short_bonds(bank, counts, min_rank)


@torch.no_grad()
def lift_short_bonds(bank: GateBank, counts: list[int], min_rank: int) -> int:
    """``keep_min_rank`` on the bonds whose live count is below ``min_rank``; ``counts``
    is updated in place."""
    lifted = 0
    short = [b for b, c in enumerate(counts) if c < min_rank]
    for b in short:
        gate = bank.gates[b]
        want = min(min_rank, gate.numel())
        if counts[b] >= want:
            continue
        threshold = bank.thresholds[b]
        top = gate.abs().topk(want).indices
        low = top[gate[top].abs() <= threshold]
        sign = torch.where(gate[low] < 0, -1.0, 1.0).to(gate.dtype)
        gate[low] = sign * 2 * threshold
        lifted += low.numel()
        counts[b] += low.numel()
    return lifted


@torch.no_grad()
def revive_fresh_deaths(bank: GateBank, counts: list[int], deficit: float,
                        optimizer: torch.optim.Optimizer | None = None,
                        unit: list[int] | None = None) -> int:
    """Switch channels that died at the threshold this step back on, the largest bond energy
    first, until the size has regained ``deficit``: under Adam a bond's gates fall at one rate
    and cross the threshold together, which would take the model far below its size.
    Revived entries sit at twice the threshold with their momentum cleared. ``counts`` is
    updated in place; returns how many."""
    candidates = []
    for b, gate in enumerate(bank.gates):
        g = gate.detach().abs()
        fresh = ((g > 0) & (g <= bank.thresholds[b])).nonzero().flatten()
        if fresh.numel():
            layer, k = bank.layers[bank.bond_layer[b]], bank.bond_k[b]
            left, right = bond_norms(layer, k)
            energy = (left * right)[fresh].tolist()
            candidates += [(e, b, int(i)) for e, i in zip(energy, fresh.tolist())]
    candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
    revived = 0
    for _, b, i in candidates:
        if deficit <= 0:
            break
        counts[b] += 1
        deficit -= bank.cost_per_channel(counts, b) * (1 if unit is None else
                                                       unit[bank.bond_layer[b]])
        gate = bank.gates[b]
        sign = -1.0 if gate[i] < 0 else 1.0
        gate[i] = sign * 2 * bank.thresholds[b]
        _clear_momentum(optimizer, gate, i)
        revived += 1
    return revived


def _clear_momentum(optimizer: torch.optim.Optimizer | None, param: torch.Tensor, i: int) -> None:
    """Zero entry ``i`` of the parameter's first-moment state (AdamW's ``exp_avg``, SGD's
    ``momentum_buffer``), so a revived gate is not carried straight back down."""
    if optimizer is None:
        return
    for name, value in optimizer.state.get(param, {}).items():
        if name in ("exp_avg", "momentum_buffer") and torch.is_tensor(value):
            if value.shape == param.shape:
                value[i] = 0


@torch.no_grad()
def freeze_dead(bank: GateBank, bonds: list[int],
                optimizer: torch.optim.Optimizer | None = None) -> None:
    """Set the dead entries of these bonds' gates to exactly 0, with their optimizer state."""
    gates = bank.gates
    for b in bonds:
        gate = gates[b]
        keep = (gate.abs() > bank.thresholds[b]).to(gate.dtype)
        gate.mul_(keep)
        _mul_state(optimizer, gate, keep)


def _mul_state(optimizer: torch.optim.Optimizer | None, param: torch.Tensor, keep) -> None:
    if optimizer is None:
        return
    for value in optimizer.state.get(param, {}).values():
        if torch.is_tensor(value) and value.shape == param.shape:
            value.mul_(keep)


@torch.no_grad()
def bond_norms(layer: TensorizedLayer, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per channel of bond ``k``: the norm of its slice in the core on its left and in the
    core on its right (the channel's energy is their product times its gate)."""
    left = full(layer.cores[k].detach())
    right = full(layer.cores[k + 1].detach()).movedim(layer.left_bond_dim, 0)
    r = left.shape[-1]
    return left.reshape(-1, r).norm(dim=0), right.reshape(r, -1).norm(dim=1)


def channel_scores(bank: GateBank) -> list[torch.Tensor]:
    """Per bond: the share of the bond's energy each live channel carries."""
    scores = []
    for b, (i, k) in enumerate(zip(bank.bond_layer, bank.bond_k)):
        layer = bank.layers[i]
        gate = layer.gates[k].detach()
        left, right = bond_norms(layer, k)
        alive = gate.abs() > bank.thresholds[b]
        energy = (gate.abs() * alive * left * right).pow(2)
        share = energy / energy.sum().clamp(min=torch.finfo(energy.dtype).tiny)
        scores.append(torch.where(alive, share, -1.0))
    return scores


def choose_removals(bank: GateBank, scores: list[float], counts: list[int], excess: float,
                    min_rank: int, unit: list[int] | None = None) -> dict[int, list[int]]:
    """Channels to switch off so the size falls by ``excess``: the smallest energy shares first
    (``scores``, flat ``channel_scores``), never below ``min_rank`` per bond, and none costing
    more than twice what is left, so the size lands nearest the budget. ``unit``: bytes per
    parameter of each layer (None: parameters). ``counts`` is updated in place; returns gate
    entry indices by bond.
    """
    bond_of, entry_of = [], []
    for b, n in enumerate(bank.sizes()):
        bond_of += [b] * n
        entry_of += range(n)
    order = sorted(
        (i for i, s in enumerate(scores) if s >= 0), key=lambda i: (scores[i], bond_of[i])
    )
    chosen: dict[int, list[int]] = {}
    for i in order:
        if excess <= 0:
            break
        b = bond_of[i]
        if counts[b] <= min_rank:
            continue
        cost = bank.cost_per_channel(counts, b) * (1 if unit is None else
                                                   unit[bank.bond_layer[b]])
        if cost > 2 * excess:
            continue
        excess -= cost
        counts[b] -= 1
        chosen.setdefault(b, []).append(entry_of[i])
    return chosen


@torch.no_grad()
def switch_off(bank: GateBank, chosen: dict[int, list[int]],
               optimizer: torch.optim.Optimizer | None = None) -> None:
    """Zero the chosen gate entries and their optimizer state (they are dead from now on)."""
    gates = bank.gates
    for b, entries in chosen.items():
        gate = gates[b]
        keep = torch.ones_like(gate)
        keep[torch.tensor(entries, device=gate.device)] = 0
        gate.mul_(keep)
        _mul_state(optimizer, gate, keep)
