"""A synthetic sentence-pair task (MNLI-shaped) that needs attention across the pair.

Each example is ``[CLS] premise [SEP] hypothesis [SEP]``. The label counts how many
hypothesis words occur in the premise: all of them -> entailment (0), none -> contradiction
(1), some -> neutral (2). No single position decides it: a model must compare the two
sentences token by token, which is what attention layers learn to do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

CLS, SEP, PAD = 0, 1, 2
FIRST_WORD = 3


@dataclass(frozen=True)
class PairTask:
    vocab_size: int = 4096
    premise_len: int = 12
    hypothesis_len: int = 4

    @property
    def seq_len(self) -> int:
        return self.premise_len + self.hypothesis_len + 3

    def batch(self, size: int, generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
        """``(input_ids, token_type_ids, labels)`` for ``size`` fresh examples."""
        words = self.vocab_size - FIRST_WORD
        labels = torch.randint(0, 3, (size,), generator=generator)
        # distinct words per example: the first premise_len of a random order of the words
        order = torch.argsort(torch.rand(size, words, generator=generator), dim=1)
        premise = FIRST_WORD + order[:, : self.premise_len]
        h = self.hypothesis_len
        # candidate hypothesis words: from the premise, and (almost surely) from outside it
        inside = premise.gather(
            1, torch.argsort(torch.rand(size, self.premise_len, generator=generator))[:, :h]
        )
        outside = FIRST_WORD + torch.randint(0, words, (size, h), generator=generator)
        outside = torch.where(
            (outside[:, :, None] == premise[:, None, :]).any(-1),
            (outside - FIRST_WORD + 1) % words + FIRST_WORD,
            outside,
        )
        n_inside = torch.where(
            labels == 0,
            h,
            torch.where(labels == 1, 0, torch.randint(1, h, (size,), generator=generator)),
        )
        take_inside = torch.arange(h)[None, :] < n_inside[:, None]
        hypothesis = torch.where(take_inside, inside, outside)
        hypothesis = hypothesis.gather(1, torch.argsort(torch.rand(size, h, generator=generator)))
        cls = torch.full((size, 1), CLS)
        sep = torch.full((size, 1), SEP)
        ids = torch.cat([cls, premise, sep, hypothesis, sep], dim=1)
        types = torch.cat(
            [
                torch.zeros(size, self.premise_len + 2, dtype=torch.long),
                torch.ones(size, h + 1, dtype=torch.long),
            ],
            dim=1,
        )
        return ids, types, labels
