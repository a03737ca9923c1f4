"""One line naming the machine a number was measured on (printed by benchmarks and examples)."""

from __future__ import annotations

import contextlib
import os
import platform
from collections.abc import Iterator

import torch


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_machine() -> str:
    """CPU model, usable cores, torch threads, torch version and the GPU if any."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = torch.get_num_threads()
    text = (
        f"machine: {cpu_model()}, {cores} cores, torch {torch.__version__} "
        f"({threads} thread{'' if threads == 1 else 's'})"
    )
    if torch.cuda.is_available():
        text += f", GPU {torch.cuda.get_device_name(0)}"
    return text


@contextlib.contextmanager
def reproducible(seed: int, threads: int = 1) -> Iterator[None]:
    """Seed torch, fix the thread count and ask for deterministic kernels; restore after."""
    old_threads = torch.get_num_threads()
    old_deterministic = torch.are_deterministic_algorithms_enabled()
    old_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.set_num_threads(old_threads)
        torch.use_deterministic_algorithms(old_deterministic, warn_only=old_warn_only)
