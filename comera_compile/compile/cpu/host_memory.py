"""Process-wide: keep freed host memory for reuse, or hand it back to the OS at once.

``"cache"``: large blocks kept by size (``compile.cpu.block_cache``); ``"reuse"``: glibc's
mmap and trim thresholds raised so freed blocks stay in the heap; ``"release"``: glibc's
initial thresholds, every large freed block unmapped at once. The first mode set stays.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys

import torch
from torch import nn

from comera_compile.compile.cpu import block_cache

log = logging.getLogger("comera_compile")

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
GLIBC_DEFAULT_MMAP_THRESHOLD = 128 * 1024
GLIBC_DEFAULT_TRIM_THRESHOLD = 128 * 1024
KEEP_ALL = 2**31 - 1  # mallopt takes an int: blocks up to 2 GiB come from the heap

HOST_MEMORY_MODES = ("off", "cache", "reuse", "release")
"""``"off"`` (the default) changes nothing; the others are process-wide (module docstring)."""

# mode: what set_host_memory set last (None: nothing was ever changed);
# mallopt_calls: how many times this process called mallopt through this module
_state: dict = {"mode": None, "mallopt_calls": 0}


@functools.cache
def _glibc():
    """The C library when it is glibc, else None (macOS, musl, Windows)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ctypes.CDLL(None).gnu_get_libc_version  # noqa: B018 - glibc only
    except (OSError, AttributeError):
        return None
    return libc


@functools.cache
def _mallopt():
    """glibc's ``mallopt``, or None where there is none."""
    libc = _glibc()
    if libc is None:
        return None
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def set_host_memory(mode: str) -> bool:
    """Set the process-wide mode (module docstring) for every model and tensor; ``"off"`` does
    nothing (:func:`restore_host_memory` undoes a mode). Returns False where it cannot be
    set: the C library is not glibc, or the block cache of ``"cache"`` cannot be built."""
    if mode not in HOST_MEMORY_MODES:
        raise ValueError(f"host memory mode must be one of {list(HOST_MEMORY_MODES)}, "
                         f"got {mode!r}")
    if mode == "off":
        return True
    mallopt = _mallopt()
    if mallopt is None:
        return False
    if mode == "cache":
        if not block_cache.install():
            return False
    else:
        block_cache.uninstall()
    keep = mode in ("cache", "reuse")  # under the cache, glibc serves the small blocks
    mmap = KEEP_ALL if keep else GLIBC_DEFAULT_MMAP_THRESHOLD
    trim = KEEP_ALL if keep else GLIBC_DEFAULT_TRIM_THRESHOLD
    _state["mallopt_calls"] += 2
    ok = bool(mallopt(M_MMAP_THRESHOLD, mmap)) and bool(mallopt(M_TRIM_THRESHOLD, trim))
    if ok and mode != _state["mode"]:
        what = {"cache": "is kept by size for reuse (block cache)",
                "reuse": "stays in the heap for reuse",
                "release": "goes back to the OS at once"}[mode]
        log.info(f"comera: freed host memory {what} (host_memory={mode!r})")
        _state["mode"] = mode
    return ok


def cache_for_training(model: nn.Module) -> bool:
    """``host_memory="auto"`` for a model that recomputes its bonds: on the CPU, set the
    block cache for the process unless a mode is set already. Such a step keeps little and
    makes the same full-width transients block after block; glibc's heap fragments under
    them (kept bonds pin each block's transients above the last block's), and the block
    cache reuses them by size instead. True when the cache is in effect."""
    device = next(iter(model.parameters()), torch.empty(0)).device
    if device.type != "cpu":
        return False
    if _state["mode"] is None and not set_host_memory("cache"):
        return False
    return _state["mode"] == "cache"


def host_memory_mode() -> str | None:
    """The mode :func:`set_host_memory` set last; None while nothing was changed (torch's
    allocator and glibc's own adaptive thresholds, or after :func:`restore_host_memory`)."""
    return _state["mode"]


def mallopt_calls() -> int:
    """How many times this process called glibc's ``mallopt`` through this module."""
    return _state["mallopt_calls"]


def restore_host_memory() -> bool:
    """Undo :func:`set_host_memory`: take the block cache out (torch's own CPU allocator
    again) and put glibc's initial thresholds (128 KiB) back. glibc's adaptive raising of
    the mmap threshold stays off once ``mallopt`` has set it. False where nothing was set."""
    if _state["mode"] is None:
        return False
    block_cache.uninstall()
    mallopt = _mallopt()
    if mallopt is not None:
        _state["mallopt_calls"] += 2
        mallopt(M_MMAP_THRESHOLD, GLIBC_DEFAULT_MMAP_THRESHOLD)
        mallopt(M_TRIM_THRESHOLD, GLIBC_DEFAULT_TRIM_THRESHOLD)
    _state["mode"] = None
    return True


def reusing_freed_host_memory() -> bool:
    """Whether freed host memory is kept for reuse (by the block cache or in the heap)."""
    return _state["mode"] in ("cache", "reuse")


def release_free_heap() -> bool:
    """Hand the heap's free pages and the block cache's kept blocks back to the OS (glibc's
    ``malloc_trim``), whatever the mode. Returns False where the C library is not glibc."""
    block_cache.trim()
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
