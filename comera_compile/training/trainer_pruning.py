"""The trainer's pruning: dead channels held at the size floor, budget cuts, and prunes of
eager, compiled, DDP and FSDP2 models."""

from __future__ import annotations

import torch
from torch import nn

from comera_compile.nn import PruneResult
from comera_compile.training.bank import GateBank
from comera_compile.training.compiled import worth_cutting
from comera_compile.training.distributed import unwrap
from comera_compile.training.pruning import (
    channel_scores,
    choose_removals,
    prune_model,
    revive_fresh_deaths,
    switch_off,
)


def _is_sharded(model: nn.Module) -> bool:
    """Whether FSDP2 sharded (part of) ``model``; never imports FSDP where it is absent."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def check_gates_whole(bank: GateBank) -> None:
    """Sharded gates would make every step's bookkeeping a collective: refuse them."""
    if any(type(g).__name__ == "DTensor" for g in bank.gates):
        raise ValueError("the rank gates are sharded (DTensor): shard the model with "
                         "comera_compile.training.shard, which keeps them whole on every rank, "
                         "instead of calling fully_shard yourself")


class PruneControl:
    """The pruning half of ``RankAdaptiveTrainer``."""

    def prune(self) -> dict[str, PruneResult]:
        """Drop dead rank channels now (cores, gates and optimizer state). Under DDP or FSDP
        the gates are first checked equal on every rank; a model sharded by
        ``training.shard`` is gathered, pruned and sharded again group by group."""
        self.collective.check_same(self.bank)
        model = unwrap(self.model)
        if _is_sharded(model):
            from comera_compile.training.sharded import prune_sharded

            self.last_pruned = prune_sharded(model, self.optimizer)
            self.bank.refresh_cores()  # re-sharding made new core parameters
        else:
            self.last_pruned = prune_model(model, self.optimizer)
        self.cuts += bool(self.last_pruned)
        return self.last_pruned

    def dead_share(self, counts: list[int] | None = None) -> float:
        """The share of the cores' stored parameters that a prune now would remove."""
        counts = self.bank.sizes() if counts is None else counts
        stored = sum(self.bank.layer_parameters(self.bank.sizes()))
        live = sum(self.bank.layer_parameters(counts))
        return 1.0 - live / stored if stored else 0.0

    def _prune_if_worth_it(self, counts: list[int], required: bool) -> None:
        if worth_cutting(self.model, self.dead_share(counts), required, self.steps,
                         self.total_steps):
            self.prune()

    def _hold_floor(self, counts: list[int]) -> None:
        """Where this step's deaths took the size below ``size_floor`` (and below where it
        was), switch the most energetic back on: only ``_meet_budget`` goes below it."""
        floor = self.size_floor()
        if floor is None:
            return
        deficit = min(floor, self._size_of(self._counts)) - self._size_of(counts)
        if deficit > 0:
            revive_fresh_deaths(self.bank, counts, deficit, self.optimizer, self._units())

    def _meet_budget(self, counts: list[int]) -> None:
        """Switch off the least important channels while the size lags the budget
        (``choose_removals`` updates ``counts`` to match)."""
        if self.schedule is None:
            return
        excess = self._size_of(counts) - self.schedule(self.steps)
        if excess <= 0:
            return
        scores = torch.cat(channel_scores(self.bank))
        scores = self.collective.from_first(scores).tolist()  # rank 0 decides for everyone
        chosen = choose_removals(self.bank, scores, counts, excess, self.min_rank, self._units())
        switch_off(self.bank, chosen, self.optimizer)
