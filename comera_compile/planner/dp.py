"""Our exact dynamic program over operand subsets, keeping the k best trees per subset."""

from __future__ import annotations

import math
from collections.abc import Sequence

from .costs import Objective

MAX_DP_OPERANDS = 9

Tree = int | tuple  # a leaf index or a pair of trees


def tree_to_ssa(tree: Tree, num_inputs: int) -> list[tuple[int, int]]:
    """Post-order a nested tree into an SSA path."""
    path: list[tuple[int, int]] = []

    def visit(node: Tree) -> int:
        if isinstance(node, int):
            return node
        left, right = visit(node[0]), visit(node[1])
        path.append((left, right))
        return num_inputs + len(path) - 1

    visit(tree)
    return path


def kbest_trees(inputs: Sequence[str], output: str, size_dict: dict[str, int], objective: Objective,
                training: bool = False, k: int = 1,
                max_weight_size: int | None = None) -> list[tuple[float, Tree]]:
    """The ``k`` cheapest contraction trees (cost, tree), cheapest first."""
    n = len(inputs)
    if n > MAX_DP_OPERANDS:
        raise ValueError(f"exact DP is limited to {MAX_DP_OPERANDS} operands, got {n}")
    if n == 1:
        return [(0, 0)]
    indices = sorted(size_dict)
    where = {ix: 0 for ix in indices}
    for pos, term in enumerate(inputs):
        for ix in term:
            where[ix] |= 1 << pos
    full = (1 << n) - 1
    bits = [(1 << q, where[ix], ix in output, size_dict[ix]) for q, ix in enumerate(indices)]
    open_mask = [0] * (full + 1)
    open_size = [1] * (full + 1)
    for s in range(1, full + 1):
        mask, size = 0, 1
        for bit, w, in_out, d in bits:
            if w & s and (in_out or w & ~s & full):
                mask |= bit
                size *= d
        open_mask[s], open_size[s] = mask, size
    mask_size: dict[int, int] = {}

    def size_of(mask: int) -> int:
        got = mask_size.get(mask)
        if got is None:
            got = math.prod(d for bit, _, _, d in bits if bit & mask)
            mask_size[mask] = got
        return got

    use_training = training and not objective.is_max
    is_max = objective.is_max
    best: dict[int, list[tuple[float, Tree]]] = {1 << p: [(0, p)] for p in range(n)}
    for s in sorted(range(1, full + 1), key=lambda v: v.bit_count()):
        if s.bit_count() < 2:
            continue
        if max_weight_size is not None and not s & 1 and open_size[s] >= max_weight_size:
            best[s] = []  # a cores-only intermediate as big as the dense weight
            continue
        low = s & -s
        rest = s ^ low
        cands: list[tuple[float, Tree]] = []
        sub = rest
        while True:  # every split {s1, s2} once: s1 holds the lowest operand of s
            s1 = low | sub
            s2 = s ^ s1
            if s2:
                flops = size_of(open_mask[s1] | open_mask[s2])
                size = open_size[s]
                if use_training:
                    local = objective.step(3 * flops, size + open_size[s1] + open_size[s2])
                else:
                    local = objective.step(flops, size)
                for c1, t1 in best[s1]:
                    for c2, t2 in best[s2]:
                        c = max(c1, c2, local) if is_max else c1 + c2 + local
                        cands.append((c, (t1, t2)))
            if not sub:
                break
            sub = (sub - 1) & rest
        cands.sort(key=lambda ct: ct[0])
        best[s] = cands[:k]
    return best[full]
