"""RankAdaptiveTrainer: CoMERA's two-stage rank adaptation in a plain PyTorch loop.

    trainer = RankAdaptiveTrainer(model, optimizer, target_ratio=0.2, total_steps=n)
    for x, y in data:
        loss = trainer.loss(F.cross_entropy(model(x), y))
        optimizer.zero_grad(); loss.backward(); optimizer.step()
        trainer.step()

Stage control lives in ``trainer_stages``, pruning in ``trainer_pruning`` and what a cut
means for a compiled model in ``compiled``. The stages and their reasons:
docs/rank-adaptive.md.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from comera_compile.formats import positive_int
from comera_compile.nn import PruneResult
from comera_compile.training.bank import GateBank
from comera_compile.training.compiled import COMPILED_MIN_CUT, announce_run, is_compiled
from comera_compile.training.distributed import Collective, unwrap
from comera_compile.training.groups import group_layout, regroup
from comera_compile.training.history import History
from comera_compile.training.pruning import freeze_dead, lift_short_bonds
from comera_compile.training.schedule import EARLY, LATE, Plateau, SizeTargetSchedule
from comera_compile.training.size import model_size
from comera_compile.training.start import end_ratio
from comera_compile.training.trainer_pruning import PruneControl, check_gates_whole
from comera_compile.training.trainer_stages import TARGET_TOLERANCE, StageControl

__all__ = ["COMPILED_MIN_CUT", "TARGET_TOLERANCE", "RankAdaptiveTrainer", "is_compiled"]

PRUNE_EVERY = 100
"""``prune_every="auto"``: how often dead channels are looked for and cut out."""


def _check_optimizer(optimizer: torch.optim.Optimizer | None) -> None:
    """Refuse an optimizer whose state is one flat vector over all parameters: a rank cut
    changes the parameters' sizes, and that state cannot be cut to match."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(
            "LBFGS keeps its history as flat vectors over all parameters, which no rank cut "
            "can follow; use an optimizer with per-parameter state: torch.optim.SGD, Adam, "
            "AdamW, Adagrad, RMSprop or Adafactor"
        )


def _run_length(total_steps, epochs, steps_per_epoch) -> int | None:
    if total_steps is not None and (epochs is not None or steps_per_epoch is not None):
        raise ValueError("give total_steps, or epochs and steps_per_epoch, not both")
    if (epochs is None) != (steps_per_epoch is None):
        raise ValueError("epochs and steps_per_epoch go together (total = their product)")
    if epochs is not None:
        total_steps = epochs * steps_per_epoch
    return None if total_steps is None else positive_int("total_steps", total_steps)


class RankAdaptiveTrainer(StageControl, PruneControl):
    """Adds CoMERA's rank terms to the task loss and shrinks the model as it trains.

    The size target ``S_t`` is ``target_ratio`` of the size at construction, or
    ``target_params`` / ``target_bytes``, or ``target_budget=b`` (the share ``b`` of the
    dense model, for a model built at ``start_budget(b)``); the task-loss target is
    ``task_target`` or the loss EMA at late-stage start. ``total_steps`` (or ``epochs`` and
    ``steps_per_epoch``) turns on the scheduled late stage, which reaches ``S_t`` with
    ``settle_fraction`` of it left; ``early_steps="auto"`` is a fifth of such a run (1000
    steps otherwise). ``progress=True`` shows a tqdm bar. Under DDP wrap the model in
    ``PrunableDDP``; under FSDP2 shard it with ``training.shard``.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 target_ratio: float = 0.2, early_steps: int | str | None = "auto",
                 prune_every: int | str | None = "auto", penalty_weight: float = 0.01,
                 l2_weight: float = 0.0, target_params: int | None = None,
                 target_bytes: int | None = None, task_target: float | None = None,
                 plateau_patience: int | None = None, history: bool = True, min_rank: int = 1,
                 total_steps: int | None = None, epochs: int | None = None,
                 steps_per_epoch: int | None = None, settle_fraction: float = 0.5,
                 progress: bool = False, target_budget: float | None = None) -> None:
        if sum(t is not None for t in (target_params, target_bytes, target_budget)) > 1:
            raise ValueError("give one of target_params, target_bytes and target_budget, not both")
        if target_budget is not None:  # the model was built at start_budget(target_budget)
            target_ratio = end_ratio(target_budget)
        if not 0 < target_ratio <= 1:
            raise ValueError(f"target_ratio must be in (0, 1], got {target_ratio}")
        _check_optimizer(optimizer)
        self.total_steps = _run_length(total_steps, epochs, steps_per_epoch)
        if early_steps == "auto":
            early_steps = 1000 if self.total_steps is None else max(1, self.total_steps // 5)
        if prune_every == "auto":
            prune_every = PRUNE_EVERY
        for name, value in (("early_steps", early_steps), ("prune_every", prune_every)):
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be a non-negative int or None, got {value!r}")
        min_rank = positive_int("min_rank", min_rank)
        if not 0 <= settle_fraction < 1:
            raise ValueError(f"settle_fraction must be in [0, 1), got {settle_fraction}")
        if None not in (self.total_steps, early_steps) and early_steps >= self.total_steps:
            raise ValueError(f"early_steps={early_steps} leaves no late stage in a run of "
                             f"{self.total_steps} steps; lower early_steps")
        self.model, self.optimizer = model, optimizer
        self.target_ratio, self.target_params = target_ratio, target_params
        self.target_bytes = target_bytes
        self.early_steps, self.prune_every = early_steps, prune_every
        self.penalty_weight, self.l2_weight = penalty_weight, l2_weight
        self.task_target, self.min_rank = task_target, min_rank
        self.settle_fraction = settle_fraction
        self.cuts = 0  # prunes that changed shapes (each one a recompile when compiled)
        self.plateau = Plateau(plateau_patience)
        self.bank = GateBank(unwrap(model))
        check_gates_whole(self.bank)
        self.collective = Collective()
        self.steps = 0
        self._stage = EARLY
        self.size_start: int | None = None  # S when the late stage started (for reports)
        self.size_target: float | None = None  # S_t
        self.task_loss_target: float | None = None  # L_t
        self.schedule: SizeTargetSchedule | None = None
        self.lam = 0.0  # the switch rule's choice for the next step (host copy)
        self._counts = self.bank.sizes()  # live channels per bond after the last step
        self._other = self._other_size()
        self._tensors_ready = False
        self._pending: dict[str, Tensor] = {}
        self._history = History() if history else None
        self.last_pruned: dict[str, PruneResult] = {}
        self._size_initial = self._size_of(self._counts)
        self._bar = tqdm(total=self.total_steps, unit="step") if progress else None
        if self.prune_every is not None:
            announce_run(model, self.steps, self.total_steps, self.early_steps)

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
        return model_size(unwrap(self.model), in_bytes=self.in_bytes, ranks=ranks)

    def loss(self, task_loss: Tensor) -> Tensor:
        """The task loss plus the current stage's rank terms (call once per step)."""
        task_weight, extra = self.rank_terms()
        self._pending = {"task_loss": task_loss.detach(), "rank_loss": extra.detach()}
        return task_weight * task_loss + extra

    def observe(self, task_loss: Tensor, rank_loss: Tensor | None = None) -> None:
        """Tell ``step`` this step's task loss (and rank terms) when ``loss`` was not the one
        adding the terms: a framework callback adds them as gradients instead, or adds them
        over several micro-batches of one step."""
        self._pending = {"task_loss": task_loss.detach()}
        if rank_loss is not None:
            self._pending["rank_loss"] = rank_loss.detach()

    def step(self) -> None:
        """Bookkeeping after ``optimizer.step()``: freeze dead channels, prune, maybe switch
        stage, set the next step's ``lam``, record."""
        self.steps += 1
        counts, task_loss, rank_loss = self._read()
        lift_short_bonds(self.bank, counts, self.min_rank)
        self._hold_floor(counts)
        died = [b for b, c in enumerate(counts) if c < self._counts[b]]
        freeze_dead(self.bank, died, self.optimizer)
        plateaued = self.plateau.update(task_loss) if task_loss is not None else False
        due = self.early_steps is not None and self.steps >= self.early_steps
        self.last_pruned = {}
        if self._stage == EARLY and (due or plateaued):
            self.start_late_stage(counts)
        else:
            if self._stage == LATE and self._budget_check_due():
                self._meet_budget(counts)
            if self._prune_due():
                self._prune_if_worth_it(counts, required=self._final_shapes_due())
        self._counts = counts
        size = self._size_of(counts)
        if self._stage == LATE and self.schedule is None:
            self.lam = self._switch(task_loss, size)
            self._lam.fill_(self.lam)
        if self._history is not None:
            self._record(counts, size, task_loss, rank_loss)
        if self._bar is not None:
            self._advance_bar(size, task_loss)
        self._pending = {}

    def close(self) -> None:
        """Close the progress bar (done by itself after the last step of a known-length run)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    # ----- internals ----------------------------------------------------------------------
    def _advance_bar(self, size: int, task_loss: float | None) -> None:
        """Host values ``step`` already has: no extra device-to-host transfer."""
        postfix = {"stage": self._stage, "size": f"{size / max(self._size_initial, 1):.3f}"}
        if task_loss is not None:
            postfix["loss"] = f"{task_loss:.4g}"
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(1)
        if self.total_steps is not None and self.steps >= self.total_steps:
            self.close()

    def _ensure_tensors(self) -> None:
        """``lam`` and the size scale live on the gates' device, created once."""
        if self._tensors_ready:
            return
        gates = self.bank.gates
        like = gates[0].detach() if gates else torch.zeros(())
        self._lam = like.new_full((), self.lam)
        self._size_norm = like.new_ones(())
        self._tensors_ready = True

    def _read(self) -> tuple[list[int], float | None, float | None]:
        """Live channels per bond, the task loss and the rank terms: the step's one
        device-to-host transfer (under DDP the task loss is first averaged over ranks, as
        the concatenated batch's; the rest is equal on every rank)."""
        counts = self.bank.alive_counts() if len(self.bank) else torch.zeros(0)
        losses = [self._pending.get(k) for k in ("rank_loss", "task_loss")]
        known = [v.reshape(1).to(counts) for v in losses if v is not None]
        packed = torch.cat([counts, *known])
        if losses[1] is not None:
            packed = self.collective.mean_last(packed)
        host = packed.tolist()
        n = len(self.bank)
        tail = iter(host[n:])
        rank_loss, task_loss = (None if v is None else next(tail) for v in losses)
        return [int(c) for c in host[:n]], task_loss, rank_loss

    def _other_size(self) -> int:
        """Parameters (or bytes) outside the tensorized cores and gates; shapes never change."""
        inside = {id(p) for lay in self.bank.layers for p in (*lay.cores, *lay.gates)}
        seen, total = set(), 0
        for p in unwrap(self.model).parameters():
            if id(p) not in inside and id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * (p.element_size() if self.in_bytes else 1)
        return total

    def _units(self) -> list[int] | None:
        return [lay.cores[0].element_size() for lay in self.bank.layers] if self.in_bytes else None

    def _size_of(self, counts: list[int]) -> int:
        """``S`` from per-bond live counts: host arithmetic only."""
        sizes = self.bank.layer_parameters(counts)
        units = self._units()
        if units is not None:
            sizes = [s * u for s, u in zip(sizes, units)]
        return sum(sizes) + self._other

    def _record(self, counts: list[int], size: int, task_loss: float | None,
                rank_loss: float | None) -> None:
        ranks = self.bank.ranks(counts)
        dense = sum(lay.dense_parameters for lay in self.bank.layers)
        cores = sum(lay.num_core_parameters(ranks[name])
                    for name, lay in zip(self.bank.names, self.bank.layers))
        self._history.record(
            step=self.steps,
            stage=self._stage,
            task_loss=task_loss,
            rank_loss=rank_loss,
            lam=self.lam if self._stage == LATE and self.schedule is None else None,
            budget=self.budget(),
            size=size,
            params=model_size(unwrap(self.model), ranks=ranks) if self.in_bytes else size,
            compression=dense / cores if cores else 1.0,
            pruned=sum(r.total_removed for r in self.last_pruned.values()),
            skipped=task_loss is not None and not math.isfinite(task_loss),
            ranks=ranks,
        )

    # ----- checkpoints --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Stage, step count, targets, schedule, loss EMA and history (not model, optimizer)."""
        return {"steps": self.steps, "stage": self._stage, "size_start": self.size_start,
                "size_initial": self._size_initial, "size_target": self.size_target,
                "task_loss_target": self.task_loss_target,
                "size_norm": float(self._size_norm) if self._tensors_ready else 1.0,
                "lam": self.lam, "counts": list(self._counts), "cuts": self.cuts,
                "schedule": None if self.schedule is None else vars(self.schedule).copy(),
                "plateau": self.plateau.state_dict(),
                "history": None if self._history is None else self._history.state_dict(),
                "param_groups": group_layout(unwrap(self.model), self.optimizer)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: load the model's state dict first (it resizes pruned layers), build the
        optimizer and the trainer, load this (it groups the optimizer's parameters by name
        as they were saved), then ``optimizer.load_state_dict``."""
        if self.optimizer is not None and state.get("param_groups"):
            regroup(unwrap(self.model), self.optimizer, state["param_groups"])
        self.steps, self._stage = state["steps"], state["stage"]
        self.size_start, self.size_target = state["size_start"], state["size_target"]
        self._size_initial = state.get("size_initial", self._size_initial)
        self.task_loss_target = state["task_loss_target"]
        self.lam = state.get("lam", 0.0)
        self._counts = list(state.get("counts", self.bank.sizes()))
        self.cuts = state.get("cuts", 0)
        schedule = state.get("schedule")
        self.schedule = None if schedule is None else SizeTargetSchedule(**schedule)
        self._ensure_tensors()
        self._lam.fill_(self.lam)
        self._size_norm.fill_(state["size_norm"] or 1.0)
        self.plateau.load_state_dict(state["plateau"])
        if self._bar is not None:
            self._bar.n = self.steps
            self._bar.refresh()
        if self._history is not None and state.get("history") is not None:
            self._history.load_state_dict(state["history"])
