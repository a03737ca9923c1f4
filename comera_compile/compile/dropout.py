"""Dropout for CPU graphs: each mask element from a 16-bit draw instead of a float one.

On CPU, aten's dropout draws one float per element (``bernoulli_``) from the serial
Mersenne Twister: about 45 ms for the 6.3M attention probabilities of one six-encoder
layer at batch 32 x 128, one thread, more than both of the layer's attention matmuls
together. Drawing 64-bit words and reading each as three 16-bit draws
(``aten.random`` on int64) costs about 7 ms for the same mask, and the compare and scale
fuse into inductor's kernel around it.

The keep probability is ``1 - round(p * 65536) / 65536`` (within 7.6e-6 of ``1 - p``); the
kept values are scaled by ``1 / (1 - p)`` as aten does, so the mask and scale match what
``native_dropout_backward`` applies, and the expected output is the input within 1e-5
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

LEVELS = 1 << 16  # a 16-bit draw
DRAWS_PER_WORD = 3  # of a word's four 16-bit lanes, the top one misses the sign bit


def keep_mask(shape: torch.Size, p: float, device: torch.device) -> Tensor:
    """A boolean mask whose elements are True with probability ``1 - round(p*2^16)/2^16``."""
    numel = shape.numel()
    words = torch.empty((numel + DRAWS_PER_WORD - 1) // DRAWS_PER_WORD, dtype=torch.int64,
                        device=device)
    words = aten.random.default(words)  # uniform in [0, 2^63): the low 48 bits are uniform
    lanes = words.view(torch.int16).view(-1, 4)[:, :DRAWS_PER_WORD]
    draws = lanes.reshape(-1)[:numel].view(shape)  # uniform int16 in [-2^15, 2^15)
    return draws >= round(p * LEVELS) - LEVELS // 2


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
