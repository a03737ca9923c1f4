"""Keep freed large CPU blocks by exact size, so a training step reuses the last step's.

A small C++ allocator built on first use (``host_memory="cache"``), its hash checked before
loading; :func:`install` returns False, with one INFO line, where it cannot be built."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from comera_compile.planner import native

log = logging.getLogger("comera_compile")

SOURCE = Path(__file__).with_suffix(".cpp")
NAME = "block_cache"
MIN_BYTES = 1 << 20  # below this, blocks come from the allocator the cache replaces
MAX_KEPT = 1 << 40  # bytes kept free for reuse; past that, freed blocks are unmapped
MAX_IDLE = 4096  # a kept block no request took in this many large requests is unmapped


def _command(target: Path) -> list[str]:
    """The compiler command that builds the allocator into ``target`` against this torch."""
    from torch.utils.cpp_extension import include_paths, library_paths  # needs setuptools

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    lib = library_paths()[0]
    return [os.environ.get("CXX", "c++"), "-O2", "-std=c++17", "-shared", "-fPIC",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{p}" for p in include_paths()),
            str(SOURCE), "-o", str(target), f"-L{lib}", "-lc10", f"-Wl,-rpath,{lib}"]


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The built allocator, or None (with one INFO line saying why) where it cannot be."""
    if not native.can_load():
        return None
    try:
        lib = native.load(NAME, native.build(NAME, SOURCE, _command, torch.__version__))
        size_t = ctypes.c_size_t
        lib.comera_block_cache_install.argtypes = [size_t, size_t, size_t]
        lib.comera_block_cache_stats.argtypes = [ctypes.POINTER(size_t)]
    except Exception as err:  # any failure: glibc's allocator stays
        log.info("comera: the CPU block cache could not be built (%s); torch's CPU "
                 "allocator stays", native.why_not(err))
        return None
    return lib


def _loaded() -> ctypes.CDLL | None:
    """The allocator if this process has loaded it already (never builds it)."""
    return _library() if _library.cache_info().currsize else None


@dataclass(frozen=True)
class CacheStats:
    """``mapped``: bytes the cache holds (in use or kept); ``kept``: of them, free for reuse;
    ``hits`` / ``misses``: requests served from kept blocks / by a new mapping;
    ``unmapped``: kept blocks handed back (``max_kept`` reached, or idle);
    ``peak_in_use``: the most bytes of its blocks in use at once; ``recycled``: misses
    served by resizing a kept block of another size."""

    mapped: int
    kept: int
    hits: int
    misses: int
    unmapped: int
    peak_in_use: int
    recycled: int


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
    out = (ctypes.c_size_t * 7)()
    lib = _loaded()
    if lib:
        lib.comera_block_cache_stats(out)
    return CacheStats(*out)
