"""Allocate: the ranks of every layer (or dense) so the model spends its budget where it helps."""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from comera_compile.formats import clip_ranks

Ranks = tuple[int, ...]  # full list, boundary 1s included; None stands for "dense"
MIN_COMPRESSION = 2.0
FILL = 0.95  # a budget counts as spent from this share up


@dataclass
class LayerPlan:
    """What the allocator needs to know about one eligible layer."""

    name: str
    chain_dims: tuple[int, ...]
    dense_params: int
    change: Callable[[Ranks | None], dict[str, int]]
    loss: Callable[[Ranks | None], float]
    per_bond: bool = False
    max_rank: int | None = None
    fixed: Ranks | None = None  # ranks the user gave: never moved
    forced: bool = False  # the user asked for this layer: never dense

    def params(self, ranks: Ranks | None) -> int:
        return self.dense_params + self.change(ranks)["params"]

    def smallest(self) -> Ranks:
        return self.fixed or (1,) * (len(self.chain_dims) + 1)


def _bond_limit(plan: LayerPlan, ranks: Ranks, k: int) -> int:
    """Largest useful rank of bond ``k`` given its neighbours (more would be padding)."""
    dims = plan.chain_dims
    limit = min(math.prod(dims[:k]), math.prod(dims[k:]),
                ranks[k - 1] * dims[k - 1], dims[k] * ranks[k + 1])
    return min(limit, plan.max_rank) if plan.max_rank else limit


def uniform_ranks(dims: Sequence[int], rank: int, max_rank: int | None = None) -> Ranks:
    return tuple(clip_ranks(list(dims), min(rank, max_rank) if max_rank else rank))


def _growths(plan: LayerPlan, ranks: Ranks, fine: bool) -> list[Ranks]:
    """Larger rank lists one move away: by about 1/8 of the rank, or by 1 when ``fine``."""
    def step(r: int) -> int:
        return 1 if fine else max(1, r // 8)

    if plan.per_bond:
        out = []
        for k in range(1, len(ranks) - 1):
            limit = _bond_limit(plan, ranks, k)
            if ranks[k] < limit:
                out.append((*ranks[:k], min(ranks[k] + step(ranks[k]), limit), *ranks[k + 1:]))
        return out
    top = max(ranks)
    grown = uniform_ranks(plan.chain_dims, top + step(top), plan.max_rank)
    return [grown] if grown != ranks else []


@dataclass
class _Move:
    plan: int
    new: Ranks | None
    version: int
    fine: bool


class _Allocator:
    def __init__(self, plans: list[LayerPlan], base: dict[str, float], limits: dict[str, float]):
        self.plans, self.base, self.limits = plans, base, limits
        self.states: list[Ranks | None] = []
        self.versions = [0] * len(plans)
        self.totals = dict(base)
        self.cap = 1.0 / MIN_COMPRESSION
        self.order = itertools.count()
        self.heap: list = []

    def cost(self, delta: dict[str, float]) -> float:
        return sum(delta[m] / cap for m, cap in self.limits.items())

    def delta(self, i: int, new: Ranks | None) -> dict[str, float]:
        plan, old = self.plans[i], self.states[i]
        after, before = plan.change(new), plan.change(old)
        return {m: after[m] - before[m] for m in self.limits}

    def fits(self, delta: dict[str, float]) -> bool:
        return all(self.totals[m] + delta[m] <= cap for m, cap in self.limits.items())

    def fill(self) -> float:
        return max(self.totals[m] / cap for m, cap in self.limits.items())

    def push(self, i: int, new: Ranks | None, fine: bool) -> None:
        plan = self.plans[i]
        if new is not None and plan.params(new) > self.cap * plan.dense_params:
            return
        gain = plan.loss(self.states[i]) - plan.loss(new)
        cost = self.cost(self.delta(i, new))
        if gain <= 0:
            return
        priority = math.inf if cost <= 0 else gain / cost
        move = _Move(i, new, self.versions[i], fine)
        heapq.heappush(self.heap, (-priority, next(self.order), move))

    def push_moves(self, i: int) -> None:
        plan, state = self.plans[i], self.states[i]
        if state is None or plan.fixed is not None:
            return
        for grown in _growths(plan, state, fine=False):
            self.push(i, grown, fine=False)
        if not plan.forced:
            self.push(i, None, fine=True)

    def start(self, states: list[Ranks | None]) -> bool:
        self.states = list(states)
        self.totals = dict(self.base)
        for i, state in enumerate(states):
            for m, change in self.plans[i].change(state).items():
                if m in self.totals and self.totals[m] is not None:
                    self.totals[m] += change
        return self.fits({m: 0 for m in self.limits})

    def run(self) -> None:
        self.heap = []
        for i in range(len(self.plans)):
            self.push_moves(i)
        while self.heap:
            _, _, move = heapq.heappop(self.heap)
            if move.version != self.versions[move.plan]:
                continue
            delta = self.delta(move.plan, move.new)
            if not self.fits(delta):
                state = self.states[move.plan]
                if not move.fine:  # a smaller step on the same bonds may still fit
                    bonds = _changed(state, move.new)
                    for grown in _growths(self.plans[move.plan], state, fine=True):
                        if _changed(state, grown) <= bonds:
                            self.push(move.plan, grown, fine=True)
                continue
            self.states[move.plan] = move.new
            for m in self.limits:
                self.totals[m] += delta[m]
            self.versions[move.plan] += 1
            self.push_moves(move.plan)


def _changed(old: Ranks, new: Ranks) -> set[int]:
    return {k for k, (a, b) in enumerate(zip(old, new)) if a != b}


def cheapest_states(plans: list[LayerPlan], limits: dict[str, float],
                    metric: str | None = None) -> list[Ranks | None]:
    """Each layer at rank 1 or dense, whichever costs less of the budget (or of ``metric``)."""
    states = []
    for plan in plans:
        small = plan.smallest()
        if plan.forced or plan.fixed is not None:
            states.append(small)
            continue
        change = plan.change(small)
        if metric is not None:
            cost = change[metric]
        else:
            cost = sum(change[m] / cap for m, cap in limits.items())
        states.append(small if cost < 0 else None)
    return states


def allocate(plans: list[LayerPlan], base: dict[str, float],
             limits: dict[str, float]) -> list[Ranks | None] | None:
    """Ranks for every plan (``None`` = stays dense) meeting ``limits``; None if unreachable."""
    alloc = _Allocator(plans, base, limits)
    starts = [cheapest_states(plans, limits)]
    starts += [cheapest_states(plans, limits, m) for m in limits]
    if not any(alloc.start(s) for s in starts):
        return None
    for s in starts:
        if alloc.start(s):
            break
    alloc.run()
    if alloc.fill() < FILL:
        alloc.cap = 1.0  # spend the rest on TT layers up to the dense size
        alloc.run()
    return alloc.states


def totals_of(plans: list[LayerPlan], states: list[Ranks | None],
              base: dict[str, float | None]) -> dict[str, float | None]:
    """The model's totals with each plan in its state."""
    totals = dict(base)
    for plan, state in zip(plans, states):
        for m, change in plan.change(state).items():
            if totals.get(m) is not None:
                totals[m] += change
    return totals
