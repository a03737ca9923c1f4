"""Rank-adaptive training in Hugging Face ``transformers.Trainer``.

    trainer = RankAdaptiveHFTrainer(
        model=model, args=TrainingArguments(...), train_dataset=data,
        rank_adaptation={"target_ratio": 0.3, "early_steps": 400, "prune_every": 50},
    )
    trainer.train()

``RankAdaptiveHFTrainer.compute_loss`` adds the current stage's rank terms to the model's
loss (training only, never in evaluation); ``RankAdaptiveCallback`` builds the
``RankAdaptiveTrainer`` once the Trainer has made its optimizer, with the run's length
(``state.max_steps``) so the size target is reached by the end, and does its bookkeeping
after every optimizer step. The rank trainer is ``callback.rank_trainer`` (history, sizes).

Single process (or one device) only: under the Trainer's own multi-GPU DDP a prune would
change parameter shapes inside a reducer that cannot be rebuilt from a callback; use
``prune_every=None`` there (gates are frozen at zero but not cut) and prune after training.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers import Trainer, TrainerCallback

from comera_compile.training import RankAdaptiveTrainer


class RankAdaptiveCallback(TrainerCallback):
    """Owns the ``RankAdaptiveTrainer`` of a ``transformers.Trainer`` run."""

    def __init__(self, **rank_adaptation: Any) -> None:
        self.options = rank_adaptation
        self.rank_trainer: RankAdaptiveTrainer | None = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if model is None or optimizer is None:
            raise RuntimeError("the Trainer passed no model or optimizer to its callbacks")
        options = {"total_steps": state.max_steps, **self.options}
        self.rank_trainer = RankAdaptiveTrainer(model, optimizer, **options)

    def on_step_end(self, args, state, control, **kwargs):
        if self.rank_trainer is not None:
            self.rank_trainer.step()


class RankAdaptiveHFTrainer(Trainer):
    """``transformers.Trainer`` whose training loss carries CoMERA's rank terms.

    ``rank_adaptation`` holds ``RankAdaptiveTrainer`` keyword arguments (targets, stages,
    pruning); the run's length comes from the Trainer.
    """

    def __init__(self, *args: Any, rank_adaptation: dict[str, Any] | None = None, **kwargs: Any):
        self.rank_callback = RankAdaptiveCallback(**(rank_adaptation or {}))
        kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), self.rank_callback]
        super().__init__(*args, **kwargs)

    @property
    def rank_trainer(self) -> RankAdaptiveTrainer | None:
        return self.rank_callback.rank_trainer

    def compute_loss(
        self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False, **kwargs
    ):
        result = super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)
        loss, outputs = result if return_outputs else (result, None)
        if self.rank_trainer is not None and model.training:
            loss = self.rank_trainer.loss(loss)
        return (loss, outputs) if return_outputs else loss
