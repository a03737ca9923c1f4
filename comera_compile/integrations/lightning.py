"""Rank-adaptive training in Lightning: one callback, no change to the LightningModule.

    trainer = lightning.Trainer(max_steps=800, callbacks=[RankAdaptation(target_ratio=0.3)])
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from lightning.pytorch import Callback

from comera_compile.training import RankAdaptiveTrainer


class RankAdaptation(Callback):
    """Adds CoMERA's rank terms to a Lightning run and shrinks the model as it trains."""

    def __init__(self, **rank_adaptation: Any) -> None:
        self.options = rank_adaptation
        self.rank_trainer: RankAdaptiveTrainer | None = None
        self._stepped_at = -1
        self._restored: dict[str, Any] | None = None  # from a checkpoint, until training starts

    def state_dict(self) -> dict[str, Any]:
        """The rank trainer's state, for Lightning's checkpoints."""
        if self.rank_trainer is None:
            return {}
        return {"rank_state": self.rank_trainer.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Lightning restores callbacks before training starts: keep it until then."""
        self._restored = state_dict.get("rank_state")

    def on_train_start(self, trainer, pl_module) -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError(
                f"RankAdaptation needs exactly one optimizer, got {len(trainer.optimizers)}"
            )
        total = trainer.estimated_stepping_batches
        options = dict(self.options)
        if math.isfinite(total):
            options.setdefault("total_steps", int(total))
        self.rank_trainer = RankAdaptiveTrainer(pl_module, trainer.optimizers[0], **options)
        self._stepped_at = trainer.global_step
        if self._restored is not None:
            self.rank_trainer.load_state_dict(self._restored)
            self._restored = None
        elif trainer.global_step > 0:
            warnings.warn(f"resumed at step {trainer.global_step} from a checkpoint without "
                          "rank-adaptation state, so the rank schedule starts again", stacklevel=2)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        weight, extra = self.rank_trainer.rank_terms()
        if not (isinstance(weight, float) and weight == 1.0):
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            torch._foreach_mul_(grads, weight)
        extra.backward()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self._stepped_at:  # accumulating: no optimizer step yet
            return
        self._stepped_at = trainer.global_step
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is not None:
            self.rank_trainer.observe(loss)
        self.rank_trainer.step()
