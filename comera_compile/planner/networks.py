"""The networks of each layer kind (TT linear, TTM linear), with boundary ranks squeezed."""

from __future__ import annotations

import string
from collections.abc import Sequence

from ..formats import internal_ranks, positive_ints, ttm_mode_pairs
from .network import BATCH, Network

_positive = positive_ints  # the name the embedding planner imports

_LETTERS = [c for c in string.ascii_lowercase + string.ascii_uppercase if c != BATCH]


def _letters(count: int) -> list[str]:
    if count > len(_LETTERS):
        raise ValueError(f"a network with {count} indices exceeds the {len(_LETTERS)} letters")
    return _LETTERS[:count]


def _chain_terms(physical: list[str], bonds: list[str]) -> list[str]:
    """Core index strings ``(r_{k-1}, phys.., r_k)`` with the boundary bonds dropped."""
    terms = []
    for k, phys in enumerate(physical):
        left = bonds[k - 1] if k > 0 else ""
        right = bonds[k] if k < len(bonds) else ""
        terms.append(left + phys + right)
    return terms


def _build(kind, x_term, cores, output, sizes) -> Network:
    names = ("x", *(f"G{k + 1}" for k in range(len(cores))))
    return Network(kind, (x_term, *cores), output, tuple(sorted(sizes.items())), names)


def tt_linear_network(in_modes: Sequence[int], out_modes: Sequence[int], ranks: int | Sequence[int],
                      rows: int) -> Network:
    """``y[b, m..] = x[b, n..] * G1[n1, r1] G2[r1, n2, r2] ... G_L[r, m_last]`` (TT linear)."""
    n = positive_ints("in_modes", in_modes)
    m = positive_ints("out_modes", out_modes)
    cores = len(n) + len(m)
    r = internal_ranks(ranks, cores)
    letters = _letters(2 * cores - 1)
    n_ix, m_ix, r_ix = letters[: len(n)], letters[len(n) : cores], letters[cores:]
    sizes = {BATCH: int(rows), **dict(zip(n_ix, n)), **dict(zip(m_ix, m)), **dict(zip(r_ix, r))}
    terms = _chain_terms(n_ix + m_ix, r_ix)
    return _build("tt_linear", BATCH + "".join(n_ix), terms, BATCH + "".join(m_ix), sizes)


def ttm_linear_network(in_modes: Sequence[int], out_modes: Sequence[int],
                       ranks: int | Sequence[int], rows: int) -> Network:
    """``y[b, m..] = x[b, n..] * G1[m1, n1, r1] ... G_d[r, m_d, n_d]`` (TTM, weight (out, in))."""
    n, m = ttm_mode_pairs(in_modes, out_modes, ("in_modes", "out_modes"))
    d = len(n)
    r = internal_ranks(ranks, d)
    letters = _letters(3 * d - 1)
    n_ix, m_ix, r_ix = letters[:d], letters[d : 2 * d], letters[2 * d :]
    sizes = {BATCH: int(rows), **dict(zip(n_ix, n)), **dict(zip(m_ix, m)), **dict(zip(r_ix, r))}
    terms = _chain_terms([mi + ni for mi, ni in zip(m_ix, n_ix)], r_ix)
    return _build("ttm_linear", BATCH + "".join(n_ix), terms, BATCH + "".join(m_ix), sizes)


def tt_linear_reference_path(network: Network) -> list[tuple[int, int]]:
    """The CoMERA paper's fixed order as an SSA path: merge the input cores left to right into L,
    the output cores right to left into R, then ``(x . L) . R``. Autotuning always times
    it beside the searched trees, so a tuned plan is never slower than the fixed order."""
    d = len(network.inputs[0]) - 1  # x carries the batch index and d input modes
    last = len(network.inputs) - 1
    path: list[tuple[int, int]] = []
    nxt = len(network.inputs)

    def pair(a: int, b: int) -> int:
        nonlocal nxt
        path.append((a, b))
        nxt += 1
        return nxt - 1

    left = 1
    for core in range(2, d + 1):
        left = pair(left, core)
    right = last
    for core in range(last - 1, d, -1):
        right = pair(core, right)
    return path + [(0, left), (nxt, right)]
