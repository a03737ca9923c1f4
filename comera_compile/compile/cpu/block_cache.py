"""Keep freed large CPU blocks by exact size, so a training step reuses the last step's.

A small C++ allocator built on first use (``host_memory="cache"``), its hash checked before
loading; :func:`install` returns False, with one INFO line, where it cannot be built."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import signal
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("comera_compile")

SOURCE = Path(__file__).with_suffix(".cpp")
MIN_BYTES = 1 << 20  # below this, blocks come from the allocator the cache replaces
MAX_KEPT = 1 << 40  # bytes kept free for reuse; past that, freed blocks are unmapped
MAX_IDLE = 4096  # a kept block no request took in this many large requests is unmapped


BUILD_TIMEOUT = 300.0  # seconds the compiler may take before the build is given up


class UnsafeCacheDir(RuntimeError):
    """The build directory is not private to this user."""


def _private_dir(path: Path) -> Path:
    """``path``, created 0700 if missing; refused unless it is a directory (not a link)
    owned by this user that no one else can write or read."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise UnsafeCacheDir(f"{path} is not a directory owned by this user")
    if info.st_mode & 0o077:
        os.chmod(path, 0o700)  # ours: tighten it
        if os.lstat(path).st_mode & 0o077:
            raise UnsafeCacheDir(f"{path} is open to other users")
    return path


def _build_dir() -> Path | None:
    """The private directory the library is built into; None under ``COMERA_CACHE_DIR=off``."""
    from comera_compile.planner.cache import cache_root

    root = cache_root()
    return None if root is None else root / "block_cache"


def _key() -> str:
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return hashlib.sha256(SOURCE.read_bytes() + f"{torch.__version__}{abi}".encode()).hexdigest()


def _compile(target: Path) -> None:
    """Run the compiler into ``target`` (in a private directory)."""
    from torch.utils.cpp_extension import include_paths, library_paths  # needs setuptools

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    lib = library_paths()[0]
    cmd = [os.environ.get("CXX", "c++"), "-O2", "-std=c++17", "-shared", "-fPIC",
           f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{p}" for p in include_paths()),
           str(SOURCE), "-o", str(target), f"-L{lib}", "-lc10", f"-Wl,-rpath,{lib}"]
    # its own process group: on timeout the compiler and anything it started are killed
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=BUILD_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd, out, err)


def _build() -> bytes:
    """The allocator built against this torch (once per source and torch version, kept in
    the private build directory with its hash), as checked bytes."""
    directory = _build_dir()
    if directory is not None:
        try:
            directory = _private_dir(directory)
        except (UnsafeCacheDir, OSError) as err:
            log.info("comera: not building the CPU block cache under %s (%s); building it "
                     "in a private temporary directory instead", directory, err)
            directory = None
    if directory is None:  # no disk cache: build in a private directory of our own, once
        with tempfile.TemporaryDirectory(prefix="comera-block-cache-") as tmp:  # 0700
            target = Path(tmp) / "block_cache.so"
            _compile(target)
            return target.read_bytes()
    key = _key()
    target = directory / f"block_cache_{key[:16]}.so"
    digest = target.with_suffix(".sha256")
    if target.exists() and digest.exists():
        data = target.read_bytes()
        if hashlib.sha256(data).hexdigest() == digest.read_text().strip():
            return data
        log.info("comera: %s does not match the hash recorded when it was built; "
                 "building it again", target)
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    try:
        _compile(partial)
        data = partial.read_bytes()
        digest_partial = digest.with_suffix(f".{os.getpid()}.sha256tmp")
        digest_partial.write_text(hashlib.sha256(data).hexdigest())
        os.replace(partial, target)  # atomic: a process beside this one never reads half
        os.replace(digest_partial, digest)
    finally:
        partial.unlink(missing_ok=True)
    return data


def _load(data: bytes) -> ctypes.CDLL:
    """Load the library from an anonymous in-memory file holding exactly ``data``."""
    fd = os.memfd_create("comera_block_cache", 0)
    try:
        os.write(fd, data)
        return ctypes.CDLL(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The built allocator, or None (with one INFO line saying why) where it cannot be."""
    if not sys.platform.startswith("linux") or not hasattr(os, "memfd_create"):
        return None
    try:
        lib = _load(_build())
        size_t = ctypes.c_size_t
        lib.comera_block_cache_install.argtypes = [size_t, size_t, size_t]
        lib.comera_block_cache_stats.argtypes = [ctypes.POINTER(size_t)]
    except Exception as err:  # any failure: glibc's allocator stays
        detail = getattr(err, "stderr", None) or str(err)
        if isinstance(detail, bytes):
            detail = detail.decode(errors="replace")
        lines = detail.strip().splitlines() or [""]
        log.info("comera: the CPU block cache could not be built (%s: %s); torch's CPU "
                 "allocator stays", type(err).__name__, lines[-1])
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
