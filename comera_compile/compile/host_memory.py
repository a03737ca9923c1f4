"""Keep freed host memory in the process for reuse, or hand it back to the OS at once.

glibc's ``malloc`` serves every block above a threshold (128 KiB, rising to at most
32 MiB) with its own ``mmap`` and unmaps it on ``free``. A training step on CPU allocates
and frees the same large activations every step (a 4096 x 3072 float tensor is 48 MiB),
so each step maps them anew and pays a page fault per 4 KiB page on first touch. With the
mmap threshold and the trim threshold raised, freed blocks stay in the heap and the next
step reuses them without faults (``benchmarks/kernels.py`` prints the difference on a GELU
over such a tensor).

The price is resident memory: what the heap held at its peak stays resident, and heap
fragmentation can add to the peak. So the compiled step reuses by default only with the
default activation memory. ``memory="low"`` *releases* by default: glibc's initial
thresholds (128 KiB) are set and its adaptive raising of them is off, so every freed block
of 128 KiB or more is unmapped at once and the resident memory is what is live. glibc's
own default sits between the two (it keeps blocks up to the largest size freed so far,
and their fragments) and is slower than reuse at about the same peak.

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

HOST_MEMORY_MODES = ("reuse", "release")

_state: dict[str, str | None] = {"mode": None}  # None: glibc's own adaptive thresholds


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
    """Process-wide: ``"reuse"`` keeps large freed blocks in the heap (no page faults when
    the next step allocates them again, more resident memory); ``"release"`` unmaps every
    freed block of 128 KiB or more at once (the least resident memory, a page fault per
    page touched anew). Returns False where the C library is not glibc."""
    if mode not in HOST_MEMORY_MODES:
        raise ValueError(f"host memory mode must be one of {list(HOST_MEMORY_MODES)}, "
                         f"got {mode!r}")
    mallopt = _mallopt()
    if mallopt is None:
        return False
    mmap = KEEP_ALL if mode == "reuse" else GLIBC_DEFAULT_MMAP_THRESHOLD
    trim = KEEP_ALL if mode == "reuse" else GLIBC_DEFAULT_TRIM_THRESHOLD
    ok = bool(mallopt(M_MMAP_THRESHOLD, mmap)) and bool(mallopt(M_TRIM_THRESHOLD, trim))
    if ok and mode != _state["mode"]:
        what = "stays in the heap for reuse" if mode == "reuse" else "goes back to the OS at once"
        log.info(f"comera: freed host memory {what} (host_memory={mode!r})")
        _state["mode"] = mode
    return ok


def host_memory_mode() -> str | None:
    """The mode :func:`set_host_memory` set last; None while glibc's defaults are in effect."""
    return _state["mode"]


def reusing_freed_host_memory() -> bool:
    """Whether freed host memory is kept for reuse."""
    return _state["mode"] == "reuse"


def release_free_heap() -> bool:
    """Hand the heap's free pages back to the OS (glibc's ``malloc_trim``), whatever the
    thresholds. Returns False where the C library is not glibc."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
