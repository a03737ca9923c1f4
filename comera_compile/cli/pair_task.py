"""A synthetic sentence-pair task (MNLI-shaped) whose answer needs both sentences."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

CLS, SEP = 0, 1
FIRST_WORD = 3  # 2 is left free for padding


@dataclass(frozen=True)
class PairTask:
    vocab_size: int = 2048
    sentence_len: int = 8
    markers: int = 16

    @property
    def seq_len(self) -> int:
        return 2 * self.sentence_len + 3

    def _sentence(self, marked: Tensor, generator: torch.Generator) -> Tensor:
        """Words with exactly ``marked[i]`` marked ones, at random places."""
        size, n = marked.shape[0], self.sentence_len
        first_plain = FIRST_WORD + self.markers
        mark = torch.randint(FIRST_WORD, first_plain, (size, n), generator=generator)
        plain = torch.randint(first_plain, self.vocab_size, (size, n), generator=generator)
        places = torch.argsort(torch.rand(size, n, generator=generator), dim=1)
        return torch.where(places < marked[:, None], mark, plain)

    def batch(self, size: int, generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
        """``(input_ids, token_type_ids, labels)`` for ``size`` fresh examples."""
        n = self.sentence_len
        labels = torch.randint(0, 3, (size,), generator=generator)
        low = torch.randint(0, n, (size,), generator=generator)
        high = low + 1 + (torch.rand(size, generator=generator) * (n - low)).long()
        high = high.clamp(max=n)
        premise_marks = torch.where(labels == 0, high, low)
        hypothesis_marks = torch.where(labels == 1, low, torch.where(labels == 0, low, high))
        premise = self._sentence(premise_marks, generator)
        hypothesis = self._sentence(hypothesis_marks, generator)
        cls, sep = torch.full((size, 1), CLS), torch.full((size, 1), SEP)
        ids = torch.cat([cls, premise, sep, hypothesis, sep], dim=1)
        types = torch.cat(
            [torch.zeros(size, n + 2, dtype=torch.long), torch.ones(size, n + 1, dtype=torch.long)],
            dim=1,
        )
        return ids, types, labels
