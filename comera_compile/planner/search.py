"""Find the contraction tree of a network: cotengra for standard objectives, our exact DP
for the gradient-aware cost and for autotuning's top-k."""

from __future__ import annotations

import contextlib
import random
import warnings
from collections.abc import Iterator

import cotengra

from .costs import Objective
from .dp import MAX_DP_OPERANDS, kbest_trees, tree_to_ssa
from .network import Network

MAX_OUTER_OPERANDS = 8
"""Up to here cotengra's exact search also tries outer products (exact over all trees)."""
MAX_OPTIMAL_OPERANDS = 16
"""Up to here cotengra's exact search runs (connected subgraphs only above the previous)."""
HYPER_REPEATS = 32
HYPER_SEED = 0


@contextlib.contextmanager
def _seeded_global_random(seed: int) -> Iterator[None]:
    """cotengra's greedy trials draw their noise (size jitter, Gumbel scores) from the global
    ``random`` module; its ``seed`` only seeds the sampler of trial settings. Seed the global
    generator for the search and give the caller's state back afterwards."""
    state = random.getstate()
    random.seed(seed)
    try:
        yield
    finally:
        random.setstate(state)


def cotengra_path(network: Network, objective: Objective) -> tuple[list[tuple[int, int]], str]:
    """SSA path from cotengra: OptimalOptimizer for small networks, else a seeded,
    serial HyperOptimizer (deterministic for a given cotengra version)."""
    inputs, output, sizes = list(network.inputs), network.output, network.size_dict
    n = len(inputs)
    if n == 1:
        return [], "trivial"
    if n <= MAX_OPTIMAL_OPERANDS:
        outer = n <= MAX_OUTER_OPERANDS
        opt = cotengra.OptimalOptimizer(minimize=objective.name, search_outer=outer)
        path = opt.ssa_path(inputs, output, sizes)
        return [tuple(map(int, p)) for p in path], (
            f"cotengra.OptimalOptimizer(search_outer={outer})"
        )
    with warnings.catch_warnings(), _seeded_global_random(HYPER_SEED):
        warnings.simplefilter("ignore")
        opt = cotengra.HyperOptimizer(methods=["greedy"], minimize=objective.name, parallel=False,
                                      max_repeats=HYPER_REPEATS, optlib="random", seed=HYPER_SEED,
                                      progbar=False)
        tree = opt.search(inputs, output, sizes)
    path = [tuple(map(int, p)) for p in tree.get_ssa_path()]
    return path, f"cotengra.HyperOptimizer(greedy, random, repeats={HYPER_REPEATS}, seed=0)"


def search_paths(network: Network, objective: Objective, training: bool = False, k: int = 1,
                 max_weight_size: int | None = None) -> tuple[list[list[tuple[int, int]]], str]:
    """Up to ``k`` candidate SSA paths, best first, and the name of the search used."""
    n = len(network.inputs)
    if (k > 1 or training or max_weight_size) and n <= MAX_DP_OPERANDS:
        trees = kbest_trees(network.inputs, network.output, network.size_dict, objective, training,
                            k, max_weight_size)
        notes = ", training" if training else ""
        notes += ", no dense weight" if max_weight_size else ""
        name = f"comera.exact_dp(k={k}{notes})"
        return [tree_to_ssa(t, n) for _, t in trees], name
    path, name = cotengra_path(network, objective)
    if training:
        name += " [plain objective: network too large for the training-cost DP]"
    return [path], name
