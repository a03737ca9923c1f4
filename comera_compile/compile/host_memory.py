"""Keep freed host memory in the process for reuse, instead of handing it back to the OS.

glibc's ``malloc`` serves every block above a threshold (128 KiB, rising to at most
32 MiB) with its own ``mmap`` and unmaps it on ``free``. A training step on CPU allocates
and frees the same large activations every step (a 4096 x 3072 float tensor is 48 MiB),
so each step maps them anew and pays a page fault per 4 KiB page on first touch. With the
mmap threshold and the trim threshold raised, freed blocks stay in the heap and the next
step reuses them without faults (``benchmarks/kernels.py`` prints the difference on a GELU
over such a tensor).

The price is resident memory: what the heap held at its peak stays resident, and heap
fragmentation can add to the peak. So the compiled step reuses by default only with the
default activation memory; ``memory="low"`` leaves the allocator as it is.

Compiling a graph allocates and frees temporary memory of its own:
:func:`release_free_heap` hands the free pages back once a graph is compiled, so reuse
keeps the step's blocks rather than the compiler's leftovers. (What the compiler keeps
alive, its modules, guards and generated code, is held, not free, and stays.)

Blocks above 32 MiB are mapped anew under glibc's defaults whatever came before; smaller
ones can be kept by glibc's own adaptive threshold, partly (``benchmarks/step.py`` prints
the page faults per step of each row, with and without reuse).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys

log = logging.getLogger("comera_compile")

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
GLIBC_DEFAULT_MMAP_THRESHOLD = 128 * 1024
GLIBC_DEFAULT_TRIM_THRESHOLD = 128 * 1024
KEEP_ALL = 2**31 - 1  # mallopt takes an int: blocks up to 2 GiB come from the heap

_state = {"reuse": False}


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


def reuse_freed_host_memory(enable: bool = True) -> bool:
    """Make large freed host blocks stay in the heap for reuse. Process-wide. Returns False
    where the C library is not glibc.

    ``enable=False`` sets glibc's initial thresholds (128 KiB) again; glibc's own raising of
    the mmap threshold as blocks are freed stays off after any ``mallopt`` call, so a process
    that never enabled reuse should not call this (the backend does not)."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    mmap = KEEP_ALL if enable else GLIBC_DEFAULT_MMAP_THRESHOLD
    trim = KEEP_ALL if enable else GLIBC_DEFAULT_TRIM_THRESHOLD
    ok = bool(mallopt(M_MMAP_THRESHOLD, mmap)) and bool(mallopt(M_TRIM_THRESHOLD, trim))
    if ok and enable and not _state["reuse"]:
        log.info("comera: freed host memory stays in the heap for reuse (host_memory='reuse')")
    _state["reuse"] = ok and enable
    return ok


def reusing_freed_host_memory() -> bool:
    """Whether :func:`reuse_freed_host_memory` is in effect."""
    return _state["reuse"]


def release_free_heap() -> bool:
    """Hand the heap's free pages back to the OS (glibc's ``malloc_trim``), whatever the
    thresholds. Returns False where the C library is not glibc."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
