"""The most a compiled training step can gain over eager on CPU, read from one eager step."""

from __future__ import annotations

import atexit
import time
from collections.abc import Iterable
from typing import Any

import torch

KEPT_KERNELS = frozenset({
    "aten::mm", "aten::addmm", "aten::_addmm_activation", "aten::bmm", "aten::baddbmm",
    "aten::addbmm", "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    "aten::mkldnn_convolution", "aten::convolution_backward",
    "aten::_slow_conv2d_forward", "aten::_slow_conv2d_backward",
})
"""Ops whose kernels compiled CPU code calls as eager does (their self time counts)."""

TRANSCENDENTAL_KERNELS = frozenset({
    "aten::gelu", "aten::gelu_backward", "aten::silu", "aten::silu_backward",
    "aten::tanh", "aten::tanh_backward", "aten::sigmoid", "aten::sigmoid_backward",
    "aten::erf", "aten::exp", "aten::log",
})
"""Elementwise ops bound by their arithmetic: their self time counts, less
``LAUNCH_US`` per call."""

LAUNCH_US = 10.0
"""What one eager elementwise op costs beyond its arithmetic on CPU (dispatch, allocation,
the autograd node): the part of a ``TRANSCENDENTAL_KERNELS`` call that fusing removes."""

OPTIMIZER_PREFIX = "Optimizer."
"""torch's optimizers record ``Optimizer.step#AdamW.step`` and ``Optimizer.zero_grad#...``
ranges (their total time counts: compiled graphs leave the optimizer eager)."""


def kept_seconds(events: Iterable[Any]) -> float:
    """Seconds of one profiled step that compiled code keeps: the self time of
    ``KEPT_KERNELS``, that of ``TRANSCENDENTAL_KERNELS`` less ``LAUNCH_US`` per call, and
    the total time of optimizer ranges, from ``key_averages()`` rows (``key``, ``count``,
    ``self_cpu_time_total`` and ``cpu_time_total``, in microseconds)."""
    kept_us = 0.0
    for row in events:
        if row.key in KEPT_KERNELS:
            kept_us += row.self_cpu_time_total
        elif row.key in TRANSCENDENTAL_KERNELS:
            kept_us += max(0.0, row.self_cpu_time_total - LAUNCH_US * row.count)
        elif row.key.startswith(OPTIMIZER_PREFIX):
            kept_us += row.cpu_time_total
    return kept_us * 1e-6


def speedup_bound(step_s: float, kept_s: float) -> float:
    """``step_s / kept_s``: the compiled step's best speedup (``inf`` if nothing is kept)."""
    return step_s / kept_s if kept_s > 0 else float("inf")


_running: set[StepProfile] = set()  # stopped at exit: a profiler left running crashes it


class StepProfile:
    """torch's CPU profiler over one training step: started at the forward call, stopped
    when an optimizer's step ends (a global post-step hook, removed with the profiler) or
    by :meth:`stop` (the model's next call, or the interpreter's exit)."""

    def __init__(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook
        from torch.profiler import ProfilerActivity, profile

        self.profiler = profile(activities=[ProfilerActivity.CPU])
        self.end: float | None = None
        self.profiler.__enter__()
        if not _running:
            atexit.register(_stop_all)
        _running.add(self)
        self.hook = register_optimizer_step_post_hook(lambda *_: self.stop())
        self.start = time.perf_counter()

    @staticmethod
    def available() -> bool:
        """Whether a step can be profiled (no other profiler is running)."""
        return not torch._C._autograd._profiler_enabled()

    def stop(self) -> None:
        if self in _running:
            self.end = time.perf_counter()
            _running.discard(self)
            self.hook.remove()
            self.profiler.__exit__(None, None, None)

    def kept(self, period: float) -> float:
        """Seconds compiled code keeps of a step of ``period`` seconds from this profile's
        start: the kept kernels' time, and what the profile did not see."""
        self.stop()
        outside = max(0.0, period - (self.end - self.start))
        return kept_seconds(self.profiler.key_averages()) + outside

    def bound(self, period: float) -> float:
        """The compiled step's best speedup, for a step of ``period`` seconds from this
        profile's start (the profiler's own time counted as the step's: an overestimate;
        ``MeasuredCompile`` divides an unprofiled step's time by ``kept``)."""
        return speedup_bound(period, self.kept(period))


def _stop_all() -> None:
    for step in list(_running):
        step.stop()
