"""Optional autotuning: time the few best trees by model cost and keep the fastest."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .network import Network

REPEATS = 5


def example_operands(network: Network, dtype: torch.dtype, device_type: str) -> list[Tensor]:
    """Random operands with the network's shapes (used when no example was given)."""
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randn(shape, generator=gen, dtype=dtype).to(device_type) for shape in network.shapes()
    ]


def _sync(device_type: str) -> None:
    if device_type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize()


def time_candidate(run: Callable[[], object], device_type: str) -> float:
    """Best-of-``REPEATS`` wall time of ``run`` after one warm-up call."""
    run()
    best = float("inf")
    for _ in range(REPEATS):
        _sync(device_type)
        start = time.perf_counter()
        run()
        _sync(device_type)
        best = min(best, time.perf_counter() - start)
    return best


def fastest(candidates: Sequence, operands: Sequence[Tensor], device_type: str):
    """The candidate plan (anything with ``execute``) whose forward + backward runs fastest
    on ``operands`` (cores need gradients in training, the input usually too)."""
    if torch.is_inference_mode_enabled():  # no autograd here: time the forward alone
        leaves, needs = list(operands), []
    else:
        leaves = [op.detach().requires_grad_(op.is_floating_point()) for op in operands]
        needs = [op for op in leaves if op.requires_grad]

    def step(plan) -> None:
        with torch.enable_grad():
            out = plan.execute(*leaves)
            if needs:
                torch.autograd.grad(out, needs, torch.ones_like(out))

    timed = [(time_candidate(lambda p=plan: step(p), device_type), k, plan)
             for k, plan in enumerate(candidates)]
    return min(timed, key=lambda t: (t[0], t[1]))[2]
