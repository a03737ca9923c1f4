"""RankAdaptiveTrainer: CoMERA's two-stage rank adaptation in a plain PyTorch loop.

    trainer = RankAdaptiveTrainer(model, optimizer, target_ratio=0.2, early_steps=2000)
    for x, y in data:
        loss = trainer.loss(F.cross_entropy(model(x), y))
        optimizer.zero_grad(); loss.backward(); optimizer.step()
        trainer.step()

``loss`` adds the terms of the current stage; ``step`` does the bookkeeping: it prunes
dead rank channels (with the optimizer state) every ``prune_every`` steps and at the
stage switch, starts the late stage when due, and records the history.

The late stage needs targets. Size ``S`` is ``model_size`` (parameters, or bytes with
``target_bytes``); its target ``S_t`` is ``target_ratio`` times ``S`` at late-stage start,
or ``target_params`` / ``target_bytes``. The task-loss target ``L_t`` is ``task_target``,
or else the task loss EMA at late-stage start (hold the loss where it was, shrink the rest).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from comera_compile.nn import PruneResult
from comera_compile.training.history import History
from comera_compile.training.penalty import (
    core_l2,
    effective_ranks,
    model_size,
    rank_penalty,
    soft_size,
    tensorized_compression,
)
from comera_compile.training.pruning import keep_min_rank, prune_model
from comera_compile.training.schedule import EARLY, LATE, Plateau, late_stage_loss, size_weight


class RankAdaptiveTrainer:
    """Adds CoMERA's rank terms to the task loss and shrinks the model as it trains."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        target_ratio: float = 0.2,
        early_steps: int | None = 1000,
        prune_every: int | None = 100,
        penalty_weight: float = 0.01,
        l2_weight: float = 0.0,
        target_params: int | None = None,
        target_bytes: int | None = None,
        task_target: float | None = None,
        plateau_patience: int | None = None,
        history: bool = True,
        min_rank: int = 1,
    ) -> None:
        if target_params is not None and target_bytes is not None:
            raise ValueError("give target_params or target_bytes, not both")
        if not 0 < target_ratio <= 1:
            raise ValueError(f"target_ratio must be in (0, 1], got {target_ratio}")
        for name, value in (("early_steps", early_steps), ("prune_every", prune_every)):
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be a non-negative int or None, got {value!r}")
        self.model, self.optimizer = model, optimizer
        self.target_ratio, self.target_params, self.target_bytes = (
            target_ratio,
            target_params,
            target_bytes,
        )
        self.early_steps, self.prune_every = early_steps, prune_every
        self.penalty_weight, self.l2_weight = penalty_weight, l2_weight
        self.task_target = task_target
        self.plateau = Plateau(plateau_patience)
        if not isinstance(min_rank, int) or min_rank < 1:
            raise ValueError(f"min_rank must be a positive int, got {min_rank!r}")
        self.min_rank = min_rank
        self.steps = 0
        self._stage = EARLY
        self.size_start: int | None = None  # S when the late stage started
        self.size_target: float | None = None  # S_t
        self.task_loss_target: float | None = None  # L_t
        self._size_norm: float | None = None  # soft_size at late-stage start, so R starts at 1
        self._pending: dict[str, Tensor | float] = {}
        self._history = History() if history else None
        self.last_pruned: dict[str, PruneResult] = {}

    # ----- what the loop calls ------------------------------------------------------------
    @property
    def stage(self) -> str:
        return self._stage

    @property
    def history(self) -> History | None:
        return self._history

    @property
    def in_bytes(self) -> bool:
        return self.target_bytes is not None

    def size(self, ranks: dict[str, list[int]] | None = None) -> int:
        """``S``: the model's size in the unit of the target (parameters or bytes)."""
        return model_size(self.model, in_bytes=self.in_bytes, ranks=ranks)

    def loss(self, task_loss: Tensor) -> Tensor:
        """The task loss plus the current stage's rank terms (call once per step)."""
        if self._stage == EARLY:
            extra = rank_penalty(self.model, self.penalty_weight, self.l2_weight)
            self._pending = {"task_loss": task_loss.detach(), "rank_loss": extra.detach()}
            return task_loss + extra
        size_term = soft_size(self.model) / self._size_norm
        lam = size_weight(
            float(task_loss.detach()), self.task_loss_target, self.size(), self.size_target
        )
        total = late_stage_loss(task_loss, size_term, lam)
        if self.l2_weight:
            total = total + self.l2_weight * core_l2(self.model)
        self._pending = {
            "task_loss": task_loss.detach(),
            "rank_loss": size_term.detach(),
            "lam": lam,
        }
        return total

    def step(self) -> None:
        """Bookkeeping after ``optimizer.step()``: prune, maybe switch stage, record."""
        self.steps += 1
        keep_min_rank(self.model, self.min_rank)
        task_loss = self._pending.get("task_loss")
        plateaued = self.plateau.update(float(task_loss)) if task_loss is not None else False
        due = self.early_steps is not None and self.steps >= self.early_steps
        self.last_pruned = {}
        if self._stage == EARLY and (due or plateaued):
            self.start_late_stage()
        elif self.prune_every and self.steps % self.prune_every == 0:
            self.prune()
        if self._history is not None:
            self._record()
        self._pending = {}

    # ----- stage control ------------------------------------------------------------------
    def prune(self) -> dict[str, PruneResult]:
        """Drop dead rank channels now (cores, gates and optimizer state)."""
        self.last_pruned = prune_model(self.model, self.optimizer)
        return self.last_pruned

    def start_late_stage(self) -> None:
        """Switch to the late stage now: prune, then fix ``S_t``, ``L_t`` and the R scale."""
        self.prune()
        self.size_start = self.size()
        if self.target_bytes is not None:
            self.size_target = float(self.target_bytes)
        elif self.target_params is not None:
            self.size_target = float(self.target_params)
        else:
            self.size_target = self.target_ratio * self.size_start
        if self.task_target is not None:
            self.task_loss_target = float(self.task_target)
        elif self.plateau.ema is not None:
            self.task_loss_target = float(self.plateau.ema)
        else:
            raise RuntimeError("no task loss seen yet: call loss() before the late stage starts")
        self._size_norm = max(float(soft_size(self.model).detach()), 1e-12)
        self._stage = LATE

    @property
    def target_reached(self) -> bool:
        """True in the late stage once ``S <= S_t``."""
        return self._stage == LATE and self.size() <= self.size_target

    def _record(self) -> None:
        ranks = effective_ranks(self.model)
        row: dict[str, Any] = {"step": self.steps, "stage": self._stage}
        for key in ("task_loss", "rank_loss"):
            value = self._pending.get(key)
            row[key] = None if value is None else float(value)
        row["lam"] = self._pending.get("lam")
        row["params"] = model_size(self.model, ranks=ranks)
        row["compression"] = tensorized_compression(self.model, ranks=ranks)
        row["pruned"] = sum(r.total_removed for r in self.last_pruned.values())
        row["ranks"] = ranks
        self._history.record(**row)

    # ----- checkpoints --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Stage, step count, targets, loss EMA and history (not the model or optimizer)."""
        return {
            "steps": self.steps,
            "stage": self._stage,
            "size_start": self.size_start,
            "size_target": self.size_target,
            "task_loss_target": self.task_loss_target,
            "size_norm": self._size_norm,
            "plateau": self.plateau.state_dict(),
            "history": None if self._history is None else self._history.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: load the model's state dict first (it resizes pruned layers), then build
        or load the optimizer, then this."""
        self.steps, self._stage = state["steps"], state["stage"]
        self.size_start, self.size_target = state["size_start"], state["size_target"]
        self.task_loss_target, self._size_norm = state["task_loss_target"], state["size_norm"]
        self.plateau.load_state_dict(state["plateau"])
        if self._history is not None and state.get("history") is not None:
            self._history.load_state_dict(state["history"])
