"""Sensitivity: how much the model's output feels an error in each layer's output."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from comera_compile.passes.candidates import Candidate
from comera_compile.passes.inputs import (
    as_call,
    model_output,
    quiet_eval,
    real_rows,
    token_mask,
)

PROBES = 4
FLOOR = 0.01


def output_sensitivities(model: nn.Module, example_inputs: Any, cands: Sequence[Candidate],
                         probes: int = PROBES) -> dict[str, float]:
    """Per layer, ``s_l`` (above) at ``example_inputs``, scaled to a mean of 1 over the layers
    the output depends on and at least ``FLOOR``; a layer it does not reach (a head beside
    the one returned first) gets 1, as nothing says it matters less. Empty where no float
    output is found or the backward pass fails."""
    names: dict[int, str] = {}
    for cand in cands:
        names[id(cand.module)] = cand.name
        for alias in cand.aliases:  # a tied table looked up through another module
            try:
                names.setdefault(id(model.get_submodule(alias)), cand.name)
            except AttributeError:
                pass
    seen: list[tuple[str, Tensor]] = []

    def hook(module, inputs, output):
        name = names.get(id(module))
        if name is not None and isinstance(output, Tensor) and output.requires_grad:
            seen.append((name, output))

    mask = token_mask(example_inputs)
    flags = [(p, p.requires_grad) for p in model.parameters()]
    handles = [m.register_forward_hook(hook) for m in model.modules() if id(m) in names]
    args, kwargs = as_call(example_inputs)
    sums: dict[str, float] = {}
    try:
        with quiet_eval(model), torch.enable_grad():
            try:
                for p, _ in flags:  # so that every layer's output is in the autograd graph
                    if p.is_floating_point():
                        p.requires_grad_(True)
                y = real_rows(model_output(model(*args, **kwargs)), mask)
            except (TypeError, RuntimeError):  # no tensor output, or inference-mode weights
                return {}
            if not y.is_floating_point() or not y.requires_grad or not seen:
                return {}
            energy = float(y.detach().double().square().sum())
            if energy <= 0:
                return {}
            generator = torch.Generator().manual_seed(0)
            outs = [out for _, out in seen]
            for k in range(probes):
                v = torch.randn(y.shape, generator=generator).to(y.device, y.dtype)
                try:
                    grads = torch.autograd.grad((y * v).sum(), outs, allow_unused=True,
                                                retain_graph=k < probes - 1)
                except RuntimeError:  # an op without a backward: no evidence either way
                    return {}
                for (name, out), grad in zip(seen, grads):
                    if grad is None:
                        continue
                    part = real_rows(out.detach(), mask).double()
                    g = real_rows(grad, mask).double()
                    sums[name] = sums.get(name, 0.0) + (
                        float(part.square().sum()) * float(g.square().sum())
                        / (max(part.numel(), 1) * energy * probes))
    finally:
        for handle in handles:
            handle.remove()
        for p, flag in flags:
            p.requires_grad_(flag)
    reached = {name: s for name, s in sums.items() if s > 0}
    if not reached:
        return {}
    mean = sum(reached.values()) / len(reached)
    return {cand.name: max(FLOOR, reached.get(cand.name, mean) / mean) for cand in cands}
