"""Rank-adaptive training in Hugging Face ``transformers.Trainer``; single process only.

    trainer = RankAdaptiveHFTrainer(model=model, args=TrainingArguments(...),
                                    rank_adaptation={"target_ratio": 0.3})
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from torch import Tensor, nn
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import ExportableState

from comera_compile.io import HF_WEIGHTS
from comera_compile.io import load as load_checkpoint
from comera_compile.training import RankAdaptiveTrainer


class RankAdaptiveCallback(TrainerCallback, ExportableState):
    """Owns the ``RankAdaptiveTrainer`` of a ``transformers.Trainer`` run."""

    def __init__(self, **rank_adaptation: Any) -> None:
        self.options = rank_adaptation
        self.rank_trainer: RankAdaptiveTrainer | None = None
        self._task_loss: Tensor | None = None  # summed over the step's micro-batches
        self._rank_loss: Tensor | None = None

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the options and the rank trainer's state."""
        saved = None if self.rank_trainer is None else self.rank_trainer.state_dict()
        return {"args": dict(self.options), "attributes": {"rank_state": saved}}

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if model is None or optimizer is None:
            raise RuntimeError("the Trainer passed no model or optimizer to its callbacks")
        options = {"total_steps": state.max_steps, **self.options}
        self.rank_trainer = RankAdaptiveTrainer(model, optimizer, **options)
        if state.global_step > 0:  # resumed from a checkpoint
            saved = _saved_rank_state(state.stateful_callbacks.get(type(self).__name__))
            if saved is None or saved["steps"] != state.global_step:
                warnings.warn(
                    f"the checkpoint at step {state.global_step} holds no rank-adaptation "
                    "state of that step, so the rank schedule starts again; resume from a "
                    "checkpoint written by RankAdaptiveHFTrainer",
                    stacklevel=2,
                )
            else:
                self.rank_trainer.load_state_dict(saved)

    def add_micro_batch(self, task_loss: Tensor, rank_loss: Tensor) -> None:
        """One micro-batch's share of the step's task loss (as the Trainer weighs it)."""
        task_loss = task_loss.detach()
        self._task_loss = task_loss if self._task_loss is None else self._task_loss + task_loss
        self._rank_loss = rank_loss.detach()

    def on_step_end(self, args, state, control, **kwargs):
        if self.rank_trainer is None:
            return
        if self._task_loss is not None:
            self.rank_trainer.observe(self._task_loss, self._rank_loss)
        self._task_loss = self._rank_loss = None
        self.rank_trainer.step()


def _saved_rank_state(stored: Any) -> dict[str, Any] | None:
    if isinstance(stored, list):  # the Trainer lists several callbacks of one class
        stored = stored[-1] if stored else None
    if not isinstance(stored, dict):
        return None
    return (stored.get("attributes") or {}).get("rank_state")


class RankAdaptiveHFTrainer(Trainer):
    """``transformers.Trainer`` whose training loss carries CoMERA's rank terms."""

    def __init__(self, *args: Any, rank_adaptation: dict[str, Any] | None = None, **kwargs: Any):
        callback = RankAdaptiveCallback(**(rank_adaptation or {}))
        kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), callback]
        super().__init__(*args, **kwargs)

    @property
    def rank_callback(self) -> RankAdaptiveCallback:
        """The run's callback (the Trainer may replace it by a restored copy on resume)."""
        return next(
            cb for cb in self.callback_handler.callbacks if isinstance(cb, RankAdaptiveCallback)
        )

    @property
    def rank_trainer(self) -> RankAdaptiveTrainer | None:
        return self.rank_callback.rank_trainer

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     **kwargs):
        result = super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)
        loss, outputs = result if return_outputs else (result, None)
        if self.rank_trainer is not None and model.training:
            loss = self._add_rank_terms(loss, kwargs.get("num_items_in_batch"))
        return (loss, outputs) if return_outputs else loss

    def _add_rank_terms(self, loss: Tensor, num_items_in_batch: Any) -> Tensor:
        """``w * loss + extra``, ``extra`` weighed so that it counts once per optimizer step:
        the Trainer divides a per-batch mean by the accumulation steps, but not a loss the
        model already normalized over the whole accumulated batch."""
        steps = getattr(self, "current_gradient_accumulation_steps", None)
        steps = steps or self.args.gradient_accumulation_steps
        divided = not self._loss_is_scaled_for_accumulation(num_items_in_batch)
        weight, extra = self.rank_trainer.rank_terms()
        self.rank_callback.add_micro_batch(loss / steps if divided else loss, extra)
        return weight * loss + (extra if divided else extra / steps)

    def _loss_is_scaled_for_accumulation(self, num_items_in_batch: Any) -> bool:
        """Mirrors ``Trainer.training_step``: True when it will not divide the loss."""
        fixed = getattr(self, "loss_is_scaled_for_ga", None)
        if fixed is not None:
            return bool(fixed)
        by_model = getattr(self, "model_accepts_loss_kwargs", False)
        by_model = by_model and num_items_in_batch is not None
        return by_model or getattr(self, "compute_loss_func", None) is not None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None):
        """Weights as ``comera_compile.load`` reads them: layers take the saved (pruned) rank
        layout first, then every tensor loads exactly."""
        weights = os.path.join(resume_from_checkpoint, HF_WEIGHTS)
        if model is not None or not os.path.isfile(weights):  # FSDP, sharded, adapters
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        load_checkpoint(resume_from_checkpoint, model=self.model)
