"""Rank-adaptive training under ``torch.distributed`` data parallelism. DDP fixes its gradient
buckets to the shapes it was built with, so ``PrunableDDP`` rebuilds it after a prune."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside ``PrunableDDP`` / ``DistributedDataParallel``."""
    while isinstance(model, (PrunableDDP, DistributedDataParallel)):
        model = model.module
    return model


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class Collective:
    """The few collectives the trainer needs; no-ops without an initialised process group."""

    def mean_last(self, packed: Tensor) -> Tensor:
        """Average the last entry over ranks (the rest is equal everywhere and kept)."""
        if not _active():
            return packed
        last = packed[-1:].clone()
        dist.all_reduce(last)
        return torch.cat([packed[:-1], last / dist.get_world_size()])

    def from_first(self, tensor: Tensor) -> Tensor:
        """Rank 0's copy of ``tensor`` on every rank."""
        if not _active():
            return tensor
        tensor = tensor.clone()
        dist.broadcast(tensor, src=0)
        return tensor

    def check_same(self, bank: Any) -> None:
        """Raise on every rank if the gates differ between ranks (every rank must prune
        the same). All ranks learn the verdict, so none goes on into a prune's collectives
        and waits there for ranks that stopped."""
        if not _active() or not len(bank):
            return
        mine = bank.flat().detach()
        size = self.from_first(mine.new_tensor([mine.numel()]))
        same = int(size.item()) == mine.numel()
        if same:
            same = torch.equal(mine, self.from_first(mine))
        differ = mine.new_tensor([0.0 if same else 1.0])
        dist.all_reduce(differ)
        if differ.item():
            raise RuntimeError(
                f"rank gates differ from rank 0's on {int(differ.item())} of "
                f"{dist.get_world_size()} ranks before pruning (rank {dist.get_rank()}: "
                f"{'same' if same else 'differs'}); gradients must be averaged over ranks "
                "(wrap the model in PrunableDDP, or shard it with "
                "comera_compile.training.shard) and every rank must run the same optimizer"
            )


class PrunableDDP(nn.Module):
    """``DistributedDataParallel`` that survives pruning: rebuilt when shapes change.

    Takes DDP's keyword arguments; ``module`` is the user's model."""

    def __init__(self, module: nn.Module, **ddp_kwargs: Any) -> None:
        super().__init__()
        self.module = module
        self._ddp_kwargs = ddp_kwargs
        self._wrapper: list[DistributedDataParallel] = []  # a list: not a second submodule
        self.rebuilds = 0
        self._build()

    def _shapes(self) -> tuple[torch.Size, ...]:
        return tuple(p.shape for p in self.module.parameters())

    def _build(self) -> None:
        self._wrapper.clear()  # the old reducer goes with its wrapper, hooks included
        self._wrapper.append(DistributedDataParallel(self.module, **self._ddp_kwargs))
        self._built_for = self._shapes()

    def rebuild(self) -> None:
        """Make a fresh DDP wrapper for the current parameter shapes."""
        self._build()
        self.rebuilds += 1

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._shapes() != self._built_for:
            self.rebuild()
        return self._wrapper[0](*args, **kwargs)
