"""Plan caches: an in-memory LRU (hit on every forward) over a JSON-file disk cache, both
bounded since pruning keeps making new networks. ``COMERA_CACHE_DIR=off`` turns the disk off."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import warnings
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import cotengra
import torch
from torch import Tensor

from .costs import evaluate_path, parse_objective
from .network import BATCH, Network, next_power_of_two
from .plan import FORMAT_VERSION, Plan
from .planning import plan_network

log = logging.getLogger(__name__)

MAX_REQUESTS = 4096
"""In-memory plans kept per exact request (network, dtype, device, options)."""
MAX_BUCKETS = 1024
"""In-memory plans kept per bucketed network (several row counts share one)."""
MAX_DISK_ENTRIES = 2048
"""Plan files kept in the disk cache directory (a few kB each)."""


class LRU(OrderedDict):
    """A dict bounded to ``maxsize`` entries that forgets the least recently used first."""

    def __init__(self, maxsize: int) -> None:
        super().__init__()
        self.maxsize = maxsize

    def hit(self, key: Hashable) -> Plan | None:
        """The value of ``key`` (now the most recently used), or None."""
        value = self.get(key)
        if value is not None:
            self.move_to_end(key)
        return value

    def put(self, key: Hashable, value: Plan) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.maxsize:
            self.popitem(last=False)


_requests = LRU(MAX_REQUESTS)
_buckets = LRU(MAX_BUCKETS)
_unwritable: set[str] = set()


def clear_memory_cache() -> None:
    """Forget every in-memory plan (the disk cache is left alone)."""
    _requests.clear()
    _buckets.clear()
    _unwritable.clear()


def cache_root() -> Path | None:
    """The directory every disk cache of the package lives under: ``$COMERA_CACHE_DIR``
    (``off``, ``none`` or ``0``: None, no disk cache at all) or
    ``$XDG_CACHE_HOME/comera_compile`` (``~/.cache/comera_compile``)."""
    env = os.environ.get("COMERA_CACHE_DIR")
    if env:
        return None if env.strip().lower() in ("off", "none", "0") else Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "comera_compile"


def cache_dir() -> Path | None:
    """The plan cache directory, or None when ``COMERA_CACHE_DIR=off``: the directory
    ``COMERA_CACHE_DIR`` names, else ``plans`` under :func:`cache_root`."""
    root = cache_root()
    if root is None or os.environ.get("COMERA_CACHE_DIR"):
        return root
    return root / "plans"


def bucket_network(network: Network) -> Network:
    """The network with its batch index rounded up to the next power of two."""
    rows = network.rows
    if rows is None or rows == next_power_of_two(rows):
        return network
    return network.with_sizes(**{BATCH: next_power_of_two(rows)})


def disk_key(network: Network, dtype: str, device_type: str, objective: str, training: bool,
             autotune: bool) -> dict[str, Any]:
    return {"format": FORMAT_VERSION, "kind": network.kind, "equation": network.equation,
            "sizes": [list(p) for p in network.sizes], "names": list(network.names), "dtype": dtype,
            "device_type": device_type, "objective": objective, "training": training,
            "autotune": autotune}


def key_file(directory: Path, key: dict[str, Any]) -> Path:
    canonical = json.dumps(key, sort_keys=True, separators=(",", ":"))
    return directory / (hashlib.sha256(canonical.encode()).hexdigest()[:32] + ".json")


def check_entry(data: Any, key: dict[str, Any], network: Network) -> Plan:
    """The plan in a disk entry, or ValueError/KeyError/TypeError when it can't be trusted."""
    if not isinstance(data, dict) or data.get("key") != key:
        raise ValueError("entry key does not match")
    plan = Plan.from_dict(data["plan"])
    if plan.format_version != FORMAT_VERSION or plan.cotengra_version != cotengra.__version__:
        raise ValueError("entry written by another format or cotengra version")
    same = (plan.kind, plan.equation, plan.sizes, plan.names, plan.objective, plan.training)
    want = (network.kind, network.equation, network.size_dict, network.names, key["objective"],
            key["training"])
    if same != want:
        raise ValueError("entry describes another network")
    cost = evaluate_path(network.inputs, network.output, network.size_dict, plan.path,
                         plan.objective, plan.training)
    if (cost.macs, cost.peak, cost.write, cost.cost) != (plan.macs, plan.peak, plan.write,
                                                         plan.cost):
        raise ValueError("entry costs do not match its path")
    return plan


def load_entry(path: Path, key: dict[str, Any], network: Network) -> Plan | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    try:
        plan = check_entry(json.loads(text), key, network)
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        log.debug("re-planning: invalid plan cache entry %s (%s)", path, err)
        return None
    with contextlib.suppress(OSError):
        os.utime(path)  # recently used: evicted last
    return plan


def store_entry(path: Path, key: dict[str, Any], plan: Plan) -> None:
    """Write atomically (temp file + os.replace); warn once per unwritable directory."""
    directory = path.parent
    if str(directory) in _unwritable:
        return
    tmp = None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".plan-", suffix=".tmp")
        with os.fdopen(fd, "w") as fh:
            json.dump({"key": key, "plan": plan.to_dict()}, fh, indent=1)
        os.replace(tmp, path)
    except OSError as err:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        _unwritable.add(str(directory))
        warnings.warn(f"comera_compile: plan cache directory {directory} is not writable ({err}); "
                      "keeping plans in memory only. Set COMERA_CACHE_DIR to a writable directory "
                      "(or to 'off').", RuntimeWarning, stacklevel=3)
        return
    try:
        evict_oldest(directory, MAX_DISK_ENTRIES)
    except OSError as err:  # another process may be evicting too
        log.debug("plan cache eviction in %s stopped: %s", directory, err)


def evict_oldest(directory: Path, keep: int) -> None:
    """Delete the least recently used plan files beyond the newest ``keep``."""
    files = list(directory.glob("*.json"))
    if len(files) <= keep:
        return
    by_age = []
    for file in files:
        try:
            by_age.append((file.stat().st_mtime, file.name, file))
        except OSError:  # removed meanwhile by another process
            continue
    by_age.sort()
    for _, _, file in by_age[: max(0, len(by_age) - keep)]:
        file.unlink(missing_ok=True)


def get_plan(network: Network, *, dtype: torch.dtype, device_type: str, objective: str = "combo",
             autotune: bool = False, operands_example: Sequence[Tensor] | None = None,
             training: bool = False) -> Plan:
    """The plan for ``network`` with its batch index bucketed to a power of two."""
    request = (network, dtype, device_type, objective, training, autotune)
    plan = _requests.get(request)
    if plan is not None:
        _requests.move_to_end(request)
        return plan
    parse_objective(objective)  # fail at the door on a bad name
    bucketed = bucket_network(network)
    bucket_key = (bucketed, dtype, device_type, objective, training, autotune)
    plan = _buckets.hit(bucket_key)
    if plan is None:
        plan = _load_or_plan(
            bucketed, dtype, device_type, objective, training, autotune, operands_example
        )
        _buckets.put(bucket_key, plan)
    _requests.put(request, plan)
    return plan


def _load_or_plan(network, dtype, device_type, objective, training, autotune, operands_example):
    dtype_name = str(dtype).removeprefix("torch.")
    key = disk_key(network, dtype_name, device_type, objective, training, autotune)
    directory = cache_dir()
    path = key_file(directory, key) if directory is not None else None
    if path is not None:
        plan = load_entry(path, key, network)
        if plan is not None:
            return plan
    plan = plan_network(network, objective=objective, training=training, autotune=autotune,
                        dtype=dtype, device_type=device_type, operands_example=operands_example)
    if path is not None:
        store_entry(path, key, plan)
    return plan
