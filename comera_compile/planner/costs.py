"""Objectives and the cost of a contraction path, defined exactly as cotengra defines them."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

_OBJECTIVE = re.compile(r"(flops|size|write|combo|limit)(?:[-:](\d*\.?\d*))?")
DEFAULT_COMBO_FACTOR = 64


@dataclass(frozen=True)
class Objective:
    """A parsed objective name: ``kind`` in flops/size/write/combo/limit, ``factor`` for the
    last two."""

    name: str
    kind: str
    factor: float

    def step(self, flops: int, size: int) -> float:
        """The local cost of one pairwise step (``size`` aggregates by max, others by sum)."""
        if self.kind == "flops":
            return flops
        if self.kind in ("size", "write"):
            return size
        if self.kind == "combo":
            return flops + self.factor * size
        return max(flops, self.factor * size)

    @property
    def is_max(self) -> bool:
        return self.kind == "size"


def parse_objective(objective: str) -> Objective:
    """Parse ``"flops" | "size" | "write" | "combo[-F]" | "limit[-F]"`` (cotengra's names)."""
    match = _OBJECTIVE.fullmatch(str(objective))
    if not match:
        raise ValueError(f"unknown objective {objective!r}; use 'flops', 'size', 'write', 'combo', "
                         "'combo-<factor>', 'limit' or 'limit-<factor>'")
    kind, param = match.groups()
    if param and kind not in ("combo", "limit"):
        raise ValueError(f"objective {kind!r} takes no factor, got {objective!r}")
    factor: float = DEFAULT_COMBO_FACTOR
    if param:
        factor = int(param) if param.isdigit() else float(param)
    return Objective(str(objective), kind, factor)


@dataclass(frozen=True)
class PathCost:
    """Multiply-adds, largest intermediate, total elements written, and objective value."""

    macs: int
    peak: int
    write: int
    cost: float


def validate_ssa_path(num_operands: int, path: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """Check an SSA path contracts every operand exactly once into one result."""
    live = set(range(num_operands))
    nxt = num_operands
    out = []
    for pair in path:
        if len(pair) != 2:
            raise ValueError(f"path step {pair!r} is not a pair")
        i, j = (int(p) for p in pair)
        if i == j or i not in live or j not in live:
            raise ValueError(f"path step {(i, j)} refers to a missing or used operand")
        live -= {i, j}
        live.add(nxt)
        nxt += 1
        out.append((i, j))
    if len(live) != 1:
        raise ValueError(f"path leaves {len(live)} tensors uncontracted")
    return out


def evaluate_path(inputs: Sequence[str], output: str, size_dict: dict[str, int],
                  path: Sequence[Sequence[int]], objective: str | Objective = "combo",
                  training: bool = False) -> PathCost:
    """Cost of an SSA ``path`` on the network (see the module docstring for definitions)."""
    obj = parse_objective(objective) if isinstance(objective, str) else objective
    path = validate_ssa_path(len(inputs), path)
    terms: dict[int, frozenset[str]] = {k: frozenset(t) for k, t in enumerate(inputs)}
    count: dict[str, int] = {}
    for term in (*inputs, output):
        for ix in term:
            count[ix] = count.get(ix, 0) + 1
    macs = write = peak = 0
    cost: float = 0
    nxt = len(inputs)
    for i, j in path:
        a, b = terms.pop(i), terms.pop(j)
        union = a | b
        for ix in a:
            count[ix] -= 1
        for ix in b:
            count[ix] -= 1
        kept = frozenset(ix for ix in union if count[ix] > 0)
        for ix in kept:
            count[ix] += 1
        flops = math.prod(size_dict[ix] for ix in union)
        size = math.prod(size_dict[ix] for ix in kept)
        macs += flops
        write += size
        peak = max(peak, size)
        if training and not obj.is_max:
            # both operands of every step need gradients (module docstring)
            step_flops = 3 * flops
            step_size = (
                size + math.prod(size_dict[ix] for ix in a) + math.prod(size_dict[ix] for ix in b)
            )
        else:
            step_flops, step_size = flops, size
        local = obj.step(step_flops, step_size)
        cost = max(cost, local) if obj.is_max else cost + local
        terms[nxt] = kept
        nxt += 1
    return PathCost(macs, peak, write, cost)
