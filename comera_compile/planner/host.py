"""Whether the host may read device values now: not while a CUDA Graph is captured (a sync
is illegal there) nor while torch.compile traces (a read would break the graph)."""

from __future__ import annotations

import torch


def capturing() -> bool:
    """True inside CUDA Graph capture, where host syncs (timing, data-dependent shapes) fail."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def host_reads_allowed() -> bool:
    """False while compiling or capturing: code then takes its path without host reads."""
    return not (torch.compiler.is_compiling() or capturing())
