"""Length-grouped batches: the same rows regrouped by length, so text batches spend less on
padding. Only right-padded Hugging Face style batches are regrouped (an ``attention_mask``
of every real token before every pad, other entries laid out like it, ``TOKEN_KEYS``, or
one per row); anything else is left alone.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

TOKEN_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids", "position_ids",
                        "special_tokens_mask", "inputs_embeds"})
MEGABATCH = 16  # rows are sorted by length within windows of this many batches: order stays random


def _right_padded(batch: Any) -> Tensor | None:
    """The batch's mask as booleans if ``batch`` can be regrouped, else None."""
    if not isinstance(batch, dict):
        return None
    mask = batch.get("attention_mask")
    if not isinstance(mask, Tensor) or mask.dim() != 2:
        return None
    for key, value in batch.items():
        if not isinstance(value, Tensor):
            return None
        aligned = key in TOKEN_KEYS and tuple(value.shape[:2]) == tuple(mask.shape)
        if not aligned and (value.dim() != 1 or len(value) != len(mask)):
            return None  # neither laid out like the mask nor one value per row
    real = mask.bool()
    if bool((real[:, 1:] & ~real[:, :-1]).any()):  # a real token after a pad: not right padded
        return None
    return real


def _per_token(key: str, value: Tensor) -> bool:
    return key in TOKEN_KEYS and value.dim() >= 2


def length_grouped(batches: Sequence[Any], seed: int = 0,
                   passes: int | None = None) -> Iterator[Any] | None:
    """``passes`` (None: endless) over the rows of ``batches``, regrouped by length into
    batches of the same size, trailing pad columns cut; a fresh random grouping each pass.
    None when the batches are not all right-padded dicts with the same keys (use them as
    they are)."""
    masks = [_right_padded(b) for b in batches]
    if not batches or any(m is None for m in masks):
        return None
    keys = list(batches[0])
    if any(list(b) != keys for b in batches):
        return None
    size = max(len(m) for m in masks)
    rows = []  # (length, batch index, row index)
    for i, mask in enumerate(masks):
        lengths = mask.sum(1).tolist()
        rows += [(n, i, j) for j, n in enumerate(lengths)]
    return _passes(list(batches), masks, rows, keys, size, seed, passes)


def _passes(batches: list[dict], masks: list[Tensor], rows: list, keys: list[str],
            size: int, seed: int, passes: int | None) -> Iterator[dict]:
    rng = random.Random(seed)
    pads = _pad_values(batches, masks, keys)
    for _ in itertools.repeat(None) if passes is None else range(passes):
        order = rows[:]
        rng.shuffle(order)
        groups = []
        window = size * MEGABATCH
        for start in range(0, len(order), window):
            chunk = sorted(order[start:start + window], key=lambda r: r[0])
            groups += [chunk[k:k + size] for k in range(0, len(chunk), size)]
        rng.shuffle(groups)
        for group in groups:
            yield _gather(batches, masks, group, keys, pads)


def _pad_values(batches: list[dict], masks: list[Tensor], keys: list[str]) -> dict[str, Tensor]:
    """Each per-token key's value at a padded position (the tokenizer's pad id, 0 in a mask)."""
    pads = {}
    for key in keys:
        for batch, mask in zip(batches, masks):
            value = batch[key]
            if _per_token(key, value) and not bool(mask.all()):
                pads[key] = value[~mask][0]
                break
        else:
            pads[key] = torch.zeros((), dtype=batches[0][key].dtype)
    return pads


def _gather(batches: list[dict], masks: list[Tensor], group: list, keys: list[str],
            pads: dict[str, Tensor]) -> dict:
    """One batch of the rows in ``group``, as wide as its longest row."""
    length = max(1, max(n for n, _, _ in group))
    out = {}
    for key in keys:
        parts = []
        for _, i, j in group:
            value = batches[i][key][j]
            if _per_token(key, batches[i][key]):
                value = value[:length]
                if len(value) < length:  # from a narrower batch: pad it out
                    fill = pads[key].expand(length - len(value), *value.shape[1:])
                    value = torch.cat([value, fill.to(value.device, value.dtype)])
            parts.append(value)
        out[key] = torch.stack(parts)
    return out
