"""Distillation: recover a compressed model by training it to match its dense original.

Pretrained weights truncated by TT-SVD lose accuracy the task data may be too scarce to win
back; the dense model itself is a free teacher on any unlabeled input. ``distill_loss`` is the
term for a user's own loop; ``distill`` is the loop:

    student = cc.optimize(copy.deepcopy(teacher), 0.75, init="dense", compile=False)
    losses = cc.training.distill(student, teacher, batches, steps=500)

``layers`` also matches the outputs of named submodules (hidden states), which needs the
submodules to exist in the student: optimize with ``inplace=True`` on a copy keeps them.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from comera_compile.passes.inputs import as_call


def distill_loss(student: Tensor, teacher: Tensor) -> Tensor:
    """Relative squared error ``||s - t||^2 / ||t||^2``: 0 when equal, scale-free."""
    teacher = teacher.detach()
    return (student - teacher).square().sum() / teacher.square().sum().clamp_min(1e-12)


def model_output(output: Any) -> Tensor:
    """The tensor to match: a tensor, ``last_hidden_state``, ``logits``, or the first item."""
    if isinstance(output, Tensor):
        return output
    for key in ("last_hidden_state", "logits"):
        value = getattr(output, key, None)
        if value is None and isinstance(output, dict):
            value = output.get(key)
        if isinstance(value, Tensor):
            return value
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
        return output[0]
    raise TypeError(f"cannot find a tensor to match in a {type(output).__name__}; pass "
                    "output_fn= to pick one")


class _Recorder:
    """Forward hooks that keep the outputs of named submodules for one call."""

    def __init__(self, model: nn.Module, names: Sequence[str], role: str) -> None:
        modules = dict(model.named_modules())
        missing = [n for n in names if n not in modules]
        if missing:
            raise ValueError(f"{role} has no submodule {missing[0]!r} to match; a captured "
                             "graph inlines submodules: optimize a copy with inplace=True")
        self.outputs: dict[str, Tensor] = {}
        self.handles = [modules[n].register_forward_hook(self._hook(n)) for n in names]

    def _hook(self, name: str) -> Callable:
        def hook(module, inputs, output):
            self.outputs[name] = model_output(output)
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def distill(
    student: nn.Module,
    teacher: nn.Module,
    batches: Iterable[Any],
    *,
    steps: int | None = None,
    lr: float = 1e-3,
    optimizer: torch.optim.Optimizer | None = None,
    output_fn: Callable[[Any, Any], Tensor] | None = None,
    layers: Sequence[str] = (),
    layer_weight: float = 1.0,
    time_limit: float | None = None,
    dropout: bool = False,
    progress: bool = True,
) -> list[float]:
    """Train ``student`` to reproduce ``teacher`` on ``batches``; returns the loss per step.

    ``batches``: inputs as ``optimize``'s ``example_inputs`` (tensor, tuple or dict), cycled
    until ``steps`` (one pass when None) or ``time_limit`` seconds. ``output_fn(output,
    batch)`` picks the tensor to match (default ``model_output``); ``layers`` adds the outputs
    of those submodules, weighted by ``layer_weight``. The teacher is never updated; the
    student runs without dropout unless ``dropout=True``, and gets its mode back afterwards.
    """
    if steps is not None and steps < 1:
        raise ValueError(f"steps must be a positive int or None, got {steps!r}")
    pick = output_fn or (lambda output, batch: model_output(output))
    params = [p for p in student.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the student has no trainable parameters")
    optimizer = optimizer or torch.optim.Adam(params, lr=lr)
    data = itertools.cycle(batches) if steps is not None else iter(batches)
    stream = itertools.islice(data, steps) if steps is not None else data
    recorders = [_Recorder(teacher, layers, "the teacher"), _Recorder(student, layers,
                                                                        "the student")]
    modes = [(m, m.training) for m in (*student.modules(), *teacher.modules())]
    student.train(dropout)
    teacher.eval()
    losses: list[float] = []
    bar = _progress(steps, progress)
    start = time.perf_counter()
    try:
        for batch in stream:
            args, kwargs = as_call(batch)
            with torch.no_grad():
                target = pick(teacher(*args, **kwargs), batch)
            got = pick(student(*args, **kwargs), batch)
            loss = distill_loss(got, target)
            for name in layers:
                loss = loss + layer_weight * distill_loss(recorders[1].outputs[name],
                                                          recorders[0].outputs[name])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{losses[-1]:.4f}")
            if time_limit is not None and time.perf_counter() - start > time_limit:
                break
    finally:
        for recorder in recorders:
            recorder.remove()
        for module, mode in modes:
            module.training = mode
        if bar is not None:
            bar.close()
    return losses


def _progress(total: int | None, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="distill", leave=False)
