"""One line naming the machine a number was measured on (printed by benchmarks and examples)."""

from __future__ import annotations

import os
import platform

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
    text = (
        f"machine: {cpu_model()}, {cores} cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads)"
    )
    if torch.cuda.is_available():
        text += f", GPU {torch.cuda.get_device_name(0)}"
    return text
