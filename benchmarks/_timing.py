"""Timing helpers shared by the benchmark scripts (median of repeated runs after warm-up)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from comera_compile.tables import text_table


def median_seconds(fn: Callable[[], object], repeats: int = 10, warmup: int = 3) -> float:
    """Median wall time of ``fn()``; synchronizes CUDA so GPU work is counted."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def forward_backward(module: torch.nn.Module, inputs: tuple, forward=None) -> Callable[[], None]:
    """A closure running forward + backward of ``module`` on ``inputs`` (grads set to None).

    The output gradient is made once, outside the timed region, as the next layer would
    hand it over in training (filling it anew each call would time a memset, not the layer).
    """
    forward = forward or module
    grad: list[torch.Tensor] = []

    def run() -> None:
        for p in module.parameters():
            p.grad = None
        out = forward(*inputs)
        if not grad or grad[0].shape != out.shape:
            grad[:] = [torch.ones_like(out)]
        out.backward(grad[0])

    return run


def table(rows: list[list[str]], header: list[str]) -> str:
    """An aligned plain-text table, numbers right-aligned as the reports print them."""
    return text_table(header, rows, right=range(len(header)))
