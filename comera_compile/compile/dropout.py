"""Dropout for CPU graphs: each mask element from a 15-bit draw instead of a float one.

On CPU, aten's dropout draws one float per element (``bernoulli_``) from the serial
Mersenne Twister: 44 ms for the mask of the 6.3M attention probabilities of one
six-encoder layer at batch 32 x 128 on one core, more than both of the layer's attention
matmuls together. Drawing 64-bit words and reading each as four 15-bit draws
(``aten.random`` on int64) makes the same mask in 13.5 ms run op by op
(``python benchmarks/kernels.py``), and under inductor the compare and scale fuse into the
kernel around it.

The keep probability is ``1 - round(p * 32768) / 32768`` (within 1.6e-5 of ``1 - p``); the
kept values are scaled by ``1 / (1 - p)`` as aten does, so the mask and scale match what
``native_dropout_backward`` applies, and the expected output is the input within 2e-5
(relative). The masks are of course other draws than eager's.

The backend hands :func:`decompositions` to AOT autograd for CPU graphs. AOT autograd's
cache does not see decomposition tables, so :class:`DropoutTag` (a post-grad pass that
changes nothing) puts this file's hash into the cache keys: a graph cached with aten's
dropout is never served for this one, or the other way round.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import Tensor, fx
from torch._inductor.custom_graph_pass import CustomGraphPass

aten = torch.ops.aten

LEVELS = 1 << 15  # each draw: the low 15 bits of a 16-bit lane
LANES = 4  # 16-bit lanes per 64-bit word; the top one lacks the sign bit, hence 15 bits


def keep_mask(shape: torch.Size, p: float, device: torch.device) -> Tensor:
    """A boolean mask whose elements are True with probability ``1 - round(p*2^15)/2^15``.

    Element ``i`` reads lane ``i`` of the words viewed as int16, so the compare runs in
    the same vectorized loop as the ops around it (no division to find a lane). The words
    are laid out along the last dimension only (``ceil(last / 4)`` words per row), so a
    symbolic batch dimension stays symbolic: no arithmetic on the element count, no
    shape guard that would pin the graph to one batch size."""
    if len(shape) == 0:
        return keep_mask(torch.Size([1]), p, device).reshape(())
    *lead, last = shape
    if not isinstance(last, int):  # a symbolic last dimension: one 15-bit draw per element
        draws = aten.random.default(torch.empty(shape, dtype=torch.int16, device=device))
        return draws >= round(p * LEVELS)
    words = torch.empty((*lead, -(-last // LANES)), dtype=torch.int64, device=device)
    words = aten.random.default(words)  # uniform in [0, 2^63): 15 uniform bits per lane
    draws = words.view(torch.int16)
    if draws.shape[-1] != last:
        draws = draws[..., :last]
    return torch.bitwise_and(draws, LEVELS - 1) >= round(p * LEVELS)


def native_dropout(input: Tensor, p: float, train: bool | None) -> tuple[Tensor, Tensor]:
    """``aten.native_dropout`` with masks from :func:`keep_mask` (same outputs otherwise)."""
    if not train or p == 0:
        return input.clone(), torch.ones_like(input, dtype=torch.bool)
    if p == 1:
        return torch.zeros_like(input), torch.zeros_like(input, dtype=torch.bool)
    keep = keep_mask(input.shape, p, input.device)
    return input * keep * (1.0 / (1.0 - p)), keep


def decompositions(fallback_random: bool = True) -> dict:
    """Inductor's decomposition table (which depends on ``fallback_random``) with
    :func:`native_dropout` in it."""
    import torch._inductor.config as inductor_config
    from torch._inductor.decomposition import select_decomp_table

    with inductor_config.patch(fallback_random=fallback_random):
        table = dict(select_decomp_table())
    table[aten.native_dropout.default] = native_dropout
    return table


class DropoutTag(CustomGraphPass):
    """Changes nothing; its uuid (this file's hash) keys the caches to this dropout."""

    def __call__(self, graph: fx.Graph) -> None:
        pass

    def uuid(self) -> bytes:
        return hashlib.sha256(Path(__file__).read_bytes()).digest()
