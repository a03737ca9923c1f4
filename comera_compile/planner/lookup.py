"""Running a TT-embedding lookup plan (``planner.embedding``): gathers and small
contractions, never the table. An embedding's cores come slices first, ``(m_k, r_{k-1}, n_k,
r_k)``, as TT-Rec stores them: an id's digit picks one contiguous slice, and a gradient that
holds only the slices read is a plain sparse tensor. By ``plan.split``: ``0`` gathers rows of
the one core; a bond ``s`` merges ``cores[:s]`` and ``cores[s:]`` into two tables, gathers a
slice of each per id and multiplies them; ``CHAIN`` contracts the chain per row, a core at a
time (eagerly in buckets of equal mode index, so each slice is read once per batch).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .gathered import GatheredChain, GatheredContraction, per_core
from .host import host_reads_allowed
from .network import next_power_of_two

if TYPE_CHECKING:
    from .embedding import EmbeddingPlan

CHAIN = -1
"""``EmbeddingPlan.split`` value for the per-core gather + per-row chain strategy."""


def run_lookup(plan: EmbeddingPlan, ids: Tensor, cores: Sequence[Tensor],
               gates: Sequence[Tensor] | None = None,
               sparse: bool | Sequence[bool] = False) -> Tensor:
    """Rows ``(len(ids), prod(col_modes))`` of the TTM table for 1-d ``ids``, run as ``plan``,
    from slices-first ``cores``. ``sparse``: the cores' gradients are sparse, the slices the
    ids read (:mod:`.gathered`), for all cores or per core; the chain then runs per core
    whatever the plan's split, as a merged half's gradient would be the whole half."""
    if ids.dim() != 1:
        raise ValueError(f"lookup expects 1-d ids, got shape {tuple(ids.shape)}")
    if len(cores) != len(plan.row_modes):
        raise ValueError(f"expected {len(plan.row_modes)} cores, got {len(cores)}")
    if plan.split == CHAIN or any(per_core(sparse, len(cores))):
        return chain_lookup(ids, cores, plan.row_modes, plan.col_modes, gates, sparse)
    if gates is not None:
        cores = [c * g.to(c.dtype) for c, g in zip(cores, gates)] + list(cores[len(gates) :])
    if plan.split == 0:
        table = cores[0].reshape(plan.row_modes[0], plan.col_modes[0])
        return table.index_select(0, ids)
    left, right = tables(plan, cores)
    _, n_left, rank, m_right, n_right = plan.halves
    a = left.index_select(0, torch.div(ids, m_right, rounding_mode="floor"))
    b = right.index_select(0, torch.remainder(ids, m_right))
    out = torch.bmm(a.reshape(-1, n_left, rank), b.reshape(-1, rank, n_right))
    return out.reshape(ids.shape[0], n_left * n_right)


def tables(plan: EmbeddingPlan, cores: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """Left ``(M_L, N_L * r_s)`` and right ``(M_R, r_s * N_R)`` tables (gather-ready)."""
    m, n, r, s = plan.row_modes, plan.col_modes, plan.ranks, plan.split
    cores = [c.transpose(0, 1) for c in cores]  # chain order (views)
    left = cores[0].reshape(m[0], n[0], r[1])
    for k in range(1, s):
        big_m, big_n = left.shape[0], left.shape[1]
        t = torch.tensordot(left, cores[k], dims=([2], [0]))  # (M, N, m, n, r')
        left = t.permute(0, 2, 1, 3, 4).reshape(big_m * m[k], big_n * n[k], r[k + 1])
    d = len(m)
    right = cores[d - 1].reshape(r[d - 1], m[d - 1], n[d - 1])
    for k in range(d - 2, s - 1, -1):
        big_m, big_n = right.shape[1], right.shape[2]
        t = torch.tensordot(cores[k], right, dims=([3], [0]))  # (r, m, n, M, N)
        right = t.permute(0, 1, 3, 2, 4).reshape(r[k], m[k] * big_m, n[k] * big_n)
    m_left, n_left, rank, m_right, n_right = plan.halves
    left = left.reshape(m_left, n_left * rank)
    right = right.permute(1, 0, 2).reshape(m_right, rank * n_right)
    return left, right


def chain_lookup(ids: Tensor, cores: Sequence[Tensor], row_modes: Sequence[int],
                 col_modes: Sequence[int], gates: Sequence[Tensor] | None = None,
                 sparse: bool | Sequence[bool] = False) -> Tensor:
    """Contract the chain per row: gather the first core's slice, then one core at a time
    (``sparse``: gathered, with sparse core gradients, :mod:`.gathered`)."""
    digits = mode_digits(ids, row_modes)
    rows = ids.shape[0]
    eager = host_reads_allowed()  # the bucketed contraction reads a depth
    if any(per_core(sparse, len(cores))) or not eager:  # every core gathered: one node
        gates = [g.to(cores[0].dtype) for g in gates] if gates is not None else []
        out = GatheredChain.apply(sparse, len(cores), *digits, *cores, *gates)
        return out.reshape(rows, math.prod(col_modes))
    acc = cores[0].index_select(0, digits[0]).squeeze(1)  # (b, n_1, r_1)
    for k in range(1, len(row_modes)):
        if gates is not None:  # scale the bond between cores k-1 and k
            acc = acc * gates[k - 1].to(acc.dtype)
        acc = _faster_contraction(acc, cores[k], digits[k])(acc, cores[k], digits[k])
    return acc.reshape(rows, math.prod(col_modes))


def mode_digits(ids: Tensor, row_modes: Sequence[int]) -> list[Tensor]:
    """Each id's index in every row mode (mixed radix, the first mode most significant)."""
    digits, rest = [], ids
    for size in reversed(row_modes[1:]):
        digits.append(torch.remainder(rest, size))
        rest = torch.div(rest, size, rounding_mode="floor")
    digits.append(rest)  # ids lie below prod(row_modes)
    digits.reverse()
    return digits


CLEAR_WIN = 4.0
"""Elements one contraction moves past this many times the other's: chosen without a trial
(a trial of the larger one would set a step's peak memory)."""
_measured: dict[tuple, str] = {}  # (ids bucketed, acc width, core shape, dtype, device) -> name


def _faster_contraction(acc: Tensor, core: Tensor, digit: Tensor):
    """Bucketed or gathered, whichever ran a forward and backward of this shape faster when
    first timed here (per power-of-two count of ids). Neither wins everywhere: bucketing
    pays where many ids share each of a core's slices and the slices are large; gathering,
    where ids are few against the core's mode or its slices small."""
    rows, width, _ = acc.shape
    key = (next_power_of_two(rows), width, *core.shape, acc.dtype, acc.device.type)
    name = _measured.get(key)
    if name is None:
        m, r, n, r_next = core.shape
        moved = {"gathered": rows * r * n * r_next,  # a slice per id, and its gradient
                 "bucketed": r * m * n * r_next + 2 * rows * width * (r + n * r_next)}
        name = min(moved, key=moved.get)
        clear = max(moved.values()) > CLEAR_WIN * min(moved.values())
        trial = not clear and not _intercepted()  # no trial the caller's hooks would see
        if trial:
            name = _time_contractions(acc.detach(), core.detach(), digit)
        if clear or trial:  # under hooks, the estimate serves this call only
            _measured[key] = name
    return _contract_bucketed if name == "bucketed" else _contract_gathered


def _time_contractions(acc: Tensor, core: Tensor, digit: Tensor, repeats: int = 3) -> str:
    """Time both contractions on these ids, forward and backward, the best of ``repeats``
    each after a first call."""
    best: dict[str, float] = {}
    a, c = acc.clone().requires_grad_(), core.clone().requires_grad_()
    with torch.enable_grad():
        for name, step in (("bucketed", _contract_bucketed), ("gathered", _contract_gathered)):
            times = []
            for _ in range(repeats + 1):
                start = time.perf_counter()
                out = step(a, c, digit)
                out.backward(torch.ones_like(out))  # a dense gradient, as a loss's is
                times.append(time.perf_counter() - start)
            best[name] = min(times[1:])
    return min(best, key=best.get)


def _intercepted() -> bool:
    """Whether saved-tensor hooks or a dispatch mode would see tensors made here."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    hooked = top_hooks is None or top_hooks(False) is not None
    return hooked or _get_current_dispatch_mode() is not None


def _contract_gathered(acc: Tensor, core: Tensor, digit: Tensor) -> Tensor:
    """``acc (b, w, r)`` times each row's slice ``core[digit]`` -> ``(b, w * n, r')``."""
    return GatheredContraction.apply(acc, core, digit, False)


def _contract_bucketed(acc: Tensor, core: Tensor, digit: Tensor) -> Tensor:
    """Same result as :func:`_contract_gathered`, as one bmm over the core's ``m`` slices."""
    rows, width, rank = acc.shape
    m, r, n, r_next = core.shape
    counts = torch.bincount(digit, minlength=m)
    depth = int(counts.max())
    order = torch.argsort(digit, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.empty_like(digit)
    slot[order] = torch.arange(rows, device=digit.device) - starts[digit[order]]
    place = digit * depth + slot
    buckets = acc.new_zeros(m * depth, width, rank).index_copy(0, place, acc)
    slices = core.reshape(m, r, n * r_next)
    out = torch.bmm(buckets.view(m, depth * width, rank), slices)
    return out.view(m * depth, width * n, r_next).index_select(0, place)
