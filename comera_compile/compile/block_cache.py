"""Keep freed large CPU blocks by exact size, so a training step reuses the last step's.

A training step allocates the same large activations in the same sizes every step. glibc
either unmaps each freed block at once (every step then pays a page fault per 4 KiB page it
touches anew: 370k faults per step for the six-encoder at batch 32 in the README's
previous low-memory row)
or keeps it in its heap, where blocks of many sizes freed in a new order leave holes that
raise the resident peak above what is live (``compile.host_memory``).

This allocator maps each block of ``min_bytes`` or more on its own (no heap, so no holes)
and, when it is freed, keeps it for the next request of exactly that size. Since a step
asks for the same sizes as the last one, steady state is free of both page faults and
fragmentation. When the sizes change (another batch shape), the sizes no longer asked for
must not stay mapped: at each request that finds no block of its size, kept blocks that no
request took in the last ``max_idle`` large requests (many training steps' worth) are
unmapped, and the bytes kept free never exceed 1.5 times the most bytes ever in use at
once (nor ``max_kept``): sizes that change every step (unpadded batches) cannot make the
cache grow past that. Smaller requests go to the allocator it replaces.

It is a small C++ file compiled against torch's c10 on first use (a C++ compiler is needed,
as for inductor on CPU; about a second, then cached) and installed with ``c10::SetCPUAllocator``:
process-wide, for tensors allocated after it. :func:`install` returns False where it cannot
be built or loaded (no compiler, not Linux), and the caller keeps glibc's allocator.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("comera_compile")

SOURCE = Path(__file__).with_suffix(".cpp")
MIN_BYTES = 1 << 20  # below this, blocks come from the allocator the cache replaces
MAX_KEPT = 1 << 40  # bytes kept free for reuse; past that, freed blocks are unmapped
MAX_IDLE = 4096  # a kept block no request took in this many large requests is unmapped


def _cache_dir() -> Path:
    root = os.environ.get("COMERA_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "comera_compile")
    return Path(root)


def _build() -> Path:
    """Compile the allocator against this torch (once per source and torch version)."""
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    key = hashlib.sha256(SOURCE.read_bytes() + f"{torch.__version__}{abi}".encode()).hexdigest()
    target = _cache_dir() / f"block_cache_{key[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    lib = library_paths()[0]
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    cmd = [os.environ.get("CXX", "c++"), "-O2", "-std=c++17", "-shared", "-fPIC",
           f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{p}" for p in include_paths()),
           str(SOURCE), "-o", str(partial), f"-L{lib}", "-lc10", f"-Wl,-rpath,{lib}"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    os.replace(partial, target)  # atomic: a process beside this one never loads half a file
    return target


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The built allocator, or None (with one INFO line saying why) where it cannot be."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, subprocess.CalledProcessError) as err:
        detail = getattr(err, "stderr", "") or str(err)
        log.info("comera: the CPU block cache could not be built (%s); glibc's allocator "
                 "stays", detail.strip().splitlines()[-1] if detail.strip() else err)
        return None
    size_t = ctypes.c_size_t
    lib.comera_block_cache_install.argtypes = [size_t, size_t, size_t]
    lib.comera_block_cache_stats.argtypes = [ctypes.POINTER(size_t)]
    return lib


def _loaded() -> ctypes.CDLL | None:
    """The allocator if this process has loaded it already (never builds it)."""
    return _library() if _library.cache_info().currsize else None


@dataclass(frozen=True)
class CacheStats:
    """``mapped``: bytes the cache holds (in use or kept); ``kept``: of them, free for reuse;
    ``hits`` / ``misses``: requests served from kept blocks / by a new mapping;
    ``unmapped``: kept blocks handed back (``max_kept`` reached, or idle);
    ``peak_in_use``: the most bytes of its blocks in use at once."""

    mapped: int
    kept: int
    hits: int
    misses: int
    unmapped: int
    peak_in_use: int


def install(min_bytes: int = MIN_BYTES, max_kept: int = MAX_KEPT,
            max_idle: int = MAX_IDLE) -> bool:
    """Make the block cache torch's CPU allocator (process-wide); False where it cannot be
    built here. Installing again changes only the limits (``min_bytes`` stays)."""
    lib = _library()
    if lib is None:
        return False
    if lib.comera_block_cache_install(min_bytes, max_kept, max_idle):
        log.info("comera: freed CPU blocks of %d KiB or more are kept for reuse by size",
                 min_bytes // 1024)
    return True


def uninstall() -> bool:
    """Give torch back the allocator the cache replaced and unmap the kept blocks; blocks
    still in use go back to the OS when freed. False when the cache was not installed."""
    lib = _loaded()
    return bool(lib and lib.comera_block_cache_uninstall())


def active() -> bool:
    """Whether the block cache is torch's CPU allocator now."""
    lib = _loaded()
    return bool(lib and lib.comera_block_cache_active())


def trim() -> None:
    """Unmap every kept block (the cache stays installed)."""
    lib = _loaded()
    if lib:
        lib.comera_block_cache_trim()


def stats() -> CacheStats:
    """The cache's counters (all zero before it is installed)."""
    out = (ctypes.c_size_t * 6)()
    lib = _loaded()
    if lib:
        lib.comera_block_cache_stats(out)
    return CacheStats(*out)
