"""Build a small C or C++ library from the package's source on first use, and load it checked.

The build is kept under the package's disk cache (``planner.cache.cache_root``), in a
directory private to this user, named by the hash of its source and its compiler command,
beside the hash of the bytes built; a library whose bytes do not match is built again, and
the bytes checked are the bytes loaded (from an anonymous in-memory file)."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("comera_compile")

BUILD_TIMEOUT = 300.0  # seconds the compiler may take before the build is given up


class UnsafeCacheDir(RuntimeError):
    """The build directory is not private to this user."""


def private_dir(path: Path) -> Path:
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


def build_dir(name: str) -> Path | None:
    """The private directory library ``name`` is built into; None under
    ``COMERA_CACHE_DIR=off``."""
    from .cache import cache_root

    root = cache_root()
    return None if root is None else root / name


def build_key(source: Path, command: Callable[[Path], list[str]], salt: str = "") -> str:
    """The hash naming a build: the source, the compiler command, and ``salt``."""
    text = " ".join(command(Path("out.so"))) + salt
    return hashlib.sha256(source.read_bytes() + text.encode()).hexdigest()


def _compile(cmd: list[str]) -> None:
    """Run the compiler (in its own process group: on timeout it and anything it started are
    killed)."""
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


def build(name: str, source: Path, command: Callable[[Path], list[str]],
          salt: str = "") -> bytes:
    """Library ``name`` built from ``source`` by ``command(target)`` (once per source, command
    and ``salt``, kept in its private build directory with its hash), as checked bytes."""
    directory = build_dir(name)
    if directory is not None:
        try:
            directory = private_dir(directory)
        except (UnsafeCacheDir, OSError) as err:
            log.info("comera: not building %s under %s (%s); building it in a private "
                     "temporary directory instead", name, directory, err)
            directory = None
    if directory is None:  # no disk cache: build in a private directory of our own, once
        with tempfile.TemporaryDirectory(prefix=f"comera-{name}-") as tmp:  # 0700
            target = Path(tmp) / f"{name}.so"
            _compile(command(target))
            return target.read_bytes()
    target = directory / f"{name}_{build_key(source, command, salt)[:16]}.so"
    digest = target.with_suffix(".sha256")
    if target.exists() and digest.exists():
        data = target.read_bytes()
        if hashlib.sha256(data).hexdigest() == digest.read_text().strip():
            return data
        log.info("comera: %s does not match the hash recorded when it was built; "
                 "building it again", target)
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    try:
        _compile(command(partial))
        data = partial.read_bytes()
        digest_partial = digest.with_suffix(f".{os.getpid()}.sha256tmp")
        digest_partial.write_text(hashlib.sha256(data).hexdigest())
        os.replace(partial, target)  # atomic: a process beside this one never reads half
        os.replace(digest_partial, digest)
    finally:
        partial.unlink(missing_ok=True)
    return data


_held_fds: list[int] = []


def load(name: str, data: bytes) -> ctypes.CDLL:
    """Load a library from an anonymous in-memory file holding exactly ``data``. The file
    stays open for the process: the loader knows a library by its path, so a second library
    loaded from a reused ``/proc/self/fd/N`` would be handed the first one."""
    fd = os.memfd_create(f"comera_{name}", 0)
    try:
        os.write(fd, data)
        lib = ctypes.CDLL(f"/proc/self/fd/{fd}")
    except BaseException:
        os.close(fd)
        raise
    _held_fds.append(fd)
    return lib


def can_load() -> bool:
    """Whether this platform loads libraries from memory (Linux)."""
    return sys.platform.startswith("linux") and hasattr(os, "memfd_create")


def why_not(err: BaseException) -> str:
    """The last line of a failed build's error, for a one-line log message."""
    detail = getattr(err, "stderr", None) or str(err)
    if isinstance(detail, bytes):
        detail = detail.decode(errors="replace")
    lines = detail.strip().splitlines() or [""]
    return f"{type(err).__name__}: {lines[-1]}"
