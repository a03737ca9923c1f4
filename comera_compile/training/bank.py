"""All rank gates of a model as one vector, so per-step bookkeeping is a few fused ops."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from comera_compile.nn import tensorized_layers

try:  # FSDP2 shards cores as DTensors; builds without torch.distributed have none
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = ()


def full(tensor: Tensor) -> Tensor:
    """The whole tensor on every rank: a sharded DTensor (an FSDP2 core) is gathered
    (differentiably), a plain tensor passes through."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@dataclass
class _Index:
    """Flat layout of the gates for one set of gate sizes."""

    sizes: list[int]  # entries per bond
    segment: Tensor  # entry -> bond
    threshold: Tensor  # entry -> its layer's threshold
    left: Tensor  # core -> index of its left rank in [1, soft bond ranks...]
    right: Tensor  # core -> index of its right rank
    physical: Tensor  # core -> product of its physical sizes


class GateBank:
    """The gates of every tensorized layer of ``model``, with fused bookkeeping."""

    def __init__(self, model: nn.Module) -> None:
        self.names, self.layers = [], []
        for name, layer in tensorized_layers(model).items():
            if not layer.gates:  # no rank to adapt (Monarch): its parameters are fixed
                continue
            self.names.append(name)
            self.layers.append(layer)
        # bond b of the flat order belongs to layer self.bond_layer[b], position self.bond_k[b]
        self.bond_layer = [i for i, lay in enumerate(self.layers) for _ in lay.gates]
        self.bond_k = [k for lay in self.layers for k in range(len(lay.gates))]
        self.thresholds = [self.layers[i].threshold for i in self.bond_layer]
        # per core: (layer physical numel, left bond or -1, right bond or -1), for host sizes
        self._cores: list[tuple[int, int, int]] = []
        bond = 0
        for layer in self.layers:
            n = len(layer.gates)
            for k, shape in enumerate(layer.core_physical_shapes()):
                left = bond + k - 1 if k > 0 else -1
                right = bond + k if k < n else -1
                self._cores.append((math.prod(shape), left, right))
            bond += n
        self._core_layer = [i for i, lay in enumerate(self.layers) for _ in lay.cores]
        # per bond: (physical numel, other bond) of the two cores it joins
        self._neighbours: list[list[tuple[int, int]]] = [[] for _ in self.bond_layer]
        for n, left, right in self._cores:
            if left >= 0:
                self._neighbours[left].append((n, right))
            if right >= 0:
                self._neighbours[right].append((n, left))
        self._index: _Index | None = None
        # Walking ParameterLists costs microseconds per item; the objects never change
        self._gates = [g for layer in self.layers for g in layer.gates]
        self.refresh_cores()

    def refresh_cores(self) -> None:
        """Re-read the core parameters: sharding a model (FSDP2) replaces them with new
        objects, at wrap time and at each sharded prune."""
        self._core_params = [c for layer in self.layers for c in layer.cores]

    def __len__(self) -> int:
        return len(self.bond_layer)

    @property
    def gates(self) -> list[nn.Parameter]:
        """Gate parameters, bond after bond (pruning keeps the objects, so this is cached)."""
        return self._gates

    def sizes(self) -> list[int]:
        return [int(g.shape[0]) for g in self.gates]

    def index(self, flat: Tensor | None = None) -> _Index:
        """The flat layout for the current gate sizes. Pruning only ever removes entries,
        so a changed total (checked against ``flat`` when given) means a rebuild."""
        if self._index is not None and flat is not None:
            if flat.shape[0] == self._index.segment.shape[0]:
                return self._index
        sizes = self.sizes()
        if self._index is None or self._index.sizes != sizes:
            self._index = self._build_index(sizes)
        return self._index

    def _build_index(self, sizes: list[int]) -> _Index:
        gates = self.gates
        device = gates[0].device if gates else torch.device("cpu")
        dtype = gates[0].dtype if gates else torch.float32
        bonds = torch.arange(len(sizes), device=device)
        counts = torch.tensor(sizes, device=device)
        thresholds = torch.tensor(self.thresholds, dtype=dtype, device=device)
        left = [1 + c[1] for c in self._cores]  # slot 0 of the rank vector holds a 1
        right = [1 + c[2] for c in self._cores]
        return _Index(
            sizes=sizes,
            segment=bonds.repeat_interleave(counts),
            threshold=thresholds.repeat_interleave(counts),
            left=torch.tensor(left, device=device),
            right=torch.tensor(right, device=device),
            physical=torch.tensor([float(c[0]) for c in self._cores], dtype=dtype, device=device),
        )

    # ----- differentiable terms ---------------------------------------------------------
    def flat(self) -> Tensor:
        """Every gate entry, bond after bond (differentiable: one concatenation)."""
        return torch.cat(self._gates)

    def active_magnitudes(self, flat: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(|g| on live entries else 0, live mask)``; dead entries get no gradient."""
        flat = self.flat() if flat is None else flat
        alive = flat.detach().abs() > self.index(flat).threshold
        return flat.abs() * alive, alive

    def penalty(self) -> Tensor:
        """Mean ``|g|`` over the live entries of all gates (0 with no gates)."""
        if not len(self):
            return torch.zeros(())
        magnitudes, alive = self.active_magnitudes()
        return magnitudes.sum() / alive.sum().clamp(min=1)

    def soft_size(self) -> Tensor:
        """Core parameters with each rank replaced by its bond's summed live ``|g|``."""
        if not self._cores:
            return torch.zeros(())
        flat = self.flat() if len(self) else None
        index = self.index(flat)
        ones = index.physical.new_ones(1)
        if flat is not None:
            magnitudes, _ = self.active_magnitudes(flat)
            soft = magnitudes.new_zeros(len(index.sizes)).index_add(0, index.segment, magnitudes)
            ranks = torch.cat([ones.to(soft.dtype), soft])
        else:
            ranks = ones
        return (index.physical * ranks[index.left] * ranks[index.right]).sum()

    def core_l2(self) -> Tensor:
        """Sum of squared core entries over all layers (one fused norm over the cores)."""
        if not self._core_params:
            return torch.zeros(())
        norms = torch._foreach_norm(self._core_params)
        return torch.stack([full(n) for n in norms]).pow(2).sum()

    # ----- counts and sizes (host side) -------------------------------------------------
    def alive_counts(self) -> Tensor:
        """Live entries per bond, as a float tensor on the gates' device (no host sync)."""
        flat = self.flat().detach()
        index = self.index(flat)
        _, alive = self.active_magnitudes(flat)
        return alive.new_zeros(len(index.sizes), dtype=index.physical.dtype).index_add_(
            0, index.segment, alive.to(index.physical.dtype)
        )

    def ranks(self, counts: list[int]) -> dict[str, list[int]]:
        """Rank lists ``[1, ..., 1]`` by layer name from per-bond live counts."""
        out, i = {}, 0
        for name, layer in zip(self.names, self.layers):
            n = len(layer.gates)
            out[name] = [1, *(int(c) for c in counts[i : i + n]), 1]
            i += n
        return out

    def layer_parameters(self, counts: list[int]) -> list[int]:
        """Per layer: core parameters at these per-bond ranks plus its live gate entries
        (host arithmetic, no device work)."""
        rank = lambda b: 1 if b < 0 else counts[b]  # noqa: E731
        sizes = [0] * len(self.layers)
        for (n, left, right), i in zip(self._cores, self._core_layer):
            sizes[i] += n * rank(left) * rank(right)
        for b, i in enumerate(self.bond_layer):
            sizes[i] += int(counts[b])
        return sizes

    def cost_per_channel(self, counts: list[int], bond: int) -> int:
        """Parameters one channel of ``bond`` costs at these ranks (both cores, one gate)."""
        neighbours = self._neighbours[bond]
        return 1 + sum(n * (1 if other < 0 else counts[other]) for n, other in neighbours)
