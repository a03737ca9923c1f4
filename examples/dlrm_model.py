"""DLRM (the Criteo Kaggle configuration) and synthetic click data with a learnable signal.

The model follows the public DLRM setup for Criteo Kaggle: 13 dense features through a
bottom MLP 13 -> 512 -> 256 -> 16, 26 categorical features through ``nn.EmbeddingBag``
tables of dimension 16 (``sparse=True``, as every real DLRM declares them), pairwise dot
products of the 27 vectors, and a top MLP 367 -> 512 -> 256 -> 1.

The data imitates what makes recommenders hard: ids follow a power law per table (a few
hot ids, a long tail seen once or never), and the click label comes from a fixed hidden
model (dense features plus hidden per-id factors and their pairwise interactions), so a
held-out log loss and AUC measure how much of that signal a model learned.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

CRITEO_KAGGLE_CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)
"""Rows of the 26 categorical features of Criteo Kaggle (about 33.8M in all)."""

DENSE_FEATURES = 13


def _mlp(sizes: Sequence[int], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if last_relu or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """Bottom MLP, embedding bags, pairwise dot interaction, top MLP -> one click logit."""

    def __init__(
        self,
        cardinalities: Sequence[int] = CRITEO_KAGGLE_CARDINALITIES,
        dim: int = 16,
        bottom: Sequence[int] = (512, 256),
        top: Sequence[int] = (512, 256),
        sparse: bool = True,
    ) -> None:
        super().__init__()
        self.bottom = _mlp((DENSE_FEATURES, *bottom, dim), last_relu=True)
        self.tables = nn.ModuleList(
            nn.EmbeddingBag(int(n), dim, mode="sum", sparse=sparse) for n in cardinalities
        )
        pairs = _lower_pairs(len(cardinalities) + 1)
        self.register_buffer("_pairs", pairs, persistent=False)
        self.top = _mlp((dim + pairs.numel(), *top, 1), last_relu=False)

    def reset_parameters(self) -> None:
        """Refill the pair indices (what a model built on the meta device needs)."""
        self._pairs.copy_(_lower_pairs(len(self.tables) + 1))

    def forward(self, dense: Tensor, sparse: Tensor) -> Tensor:
        """``dense``: (batch, 13) floats; ``sparse``: (tables, batch, ids per bag) ints.

        Returns the click logits ``(batch,)``.
        """
        x = self.bottom(dense)
        pooled = [table(sparse[i]) for i, table in enumerate(self.tables)]
        z = torch.stack([x, *pooled], dim=1)  # (batch, 27, dim)
        dots = torch.bmm(z, z.transpose(1, 2)).flatten(1).index_select(1, self._pairs)
        return self.top(torch.cat([x, dots], dim=1)).squeeze(1)


def _lower_pairs(vectors: int) -> Tensor:
    """Flat indices of the ``i > j`` entries of a ``vectors x vectors`` matrix (one gather
    picks them: its backward is an index_add, cheaper than advanced indexing's)."""
    rows, cols = torch.tril_indices(vectors, vectors, offset=-1)
    return rows * vectors + cols


class Adagrad:
    """Adagrad over a model whose tables may keep sparse gradients: one fused (single-pass)
    kernel for every dense gradient (MLPs, rank gates) and the plain kernel for the sparse
    ones (``sparse=True`` tables left dense, TT cores and caches of ``sparse=True`` tables:
    ``TTEmbedding.sparse_parameters``), since the fused one takes no sparse gradients.

    A sparse parameter of at most ``SMALL_TABLE`` entries joins the fused kernel with its
    gradient made dense first: the same update (Adagrad leaves rows with a zero gradient
    as they are), without the sparse kernel's per-table sorting."""

    SMALL_TABLE = 1 << 18

    def __init__(self, model: nn.Module, lr: float) -> None:
        sparse = {
            id(m.weight)
            for m in model.modules()
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
        }
        sparse |= {  # a TT table's cores and hot-row cache
            id(p) for m in model.modules() for p in getattr(m, "sparse_parameters", list)()
        }
        params = [p for p in model.parameters() if p.requires_grad]
        self.densified = [p for p in params if id(p) in sparse and p.numel() <= self.SMALL_TABLE]
        small = {id(p) for p in self.densified}
        dense = [p for p in params if id(p) not in sparse or id(p) in small]
        rest = [p for p in params if id(p) in sparse and id(p) not in small]
        self.optimizers = [torch.optim.Adagrad(dense, lr=lr, fused=True)] if dense else []
        if rest:
            self.optimizers.append(torch.optim.Adagrad(rest, lr=lr))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for p in self.densified:
            if p.grad is not None and p.grad.is_sparse:
                p.grad = p.grad.to_dense()
        for opt in self.optimizers:
            opt.step()


def _hash_unit(ids: Tensor, salt: int) -> Tensor:
    """A fixed pseudo-random number in [-sqrt(3), sqrt(3)) (unit variance) for each id."""
    mask = (1 << 31) - 1
    h = (ids * 1103515245 + salt * 2654435761 + 12345) & mask
    h = ((h ^ (h >> 13)) * 1274126177) & mask
    h = h ^ (h >> 16)
    return (h.double() / (mask + 1) - 0.5).float() * math.sqrt(12.0)


@dataclass(frozen=True)
class SyntheticClicks:
    """Click data from a fixed hidden model; batches are a pure function of ``(seed, step)``.

    Ids: rank ``k`` has probability about ``1/k`` (log-uniform ranks), scrambled by a
    fixed hash so hot ids are spread over the table. Label: Bernoulli of
    ``sigmoid(dense . w + sum_t a_t u_t(id) + sum_(s,t) v_s(id) . v_t(id) / 2 + bias)`` with
    hidden per-id scalars ``u`` and 2-d factors ``v`` hashed from the id (no table stored).
    """

    cardinalities: Sequence[int] = CRITEO_KAGGLE_CARDINALITIES
    bag: int = 1
    factors: int = 2
    bias: float = -1.2  # about a quarter of the samples are clicks, as in Criteo

    def ids(self, table: int, shape: tuple[int, ...], generator: torch.Generator) -> Tensor:
        rows = int(self.cardinalities[table])
        u = torch.rand(shape, generator=generator, dtype=torch.float64)
        rank = torch.floor(torch.exp(u * math.log(rows + 1))).long() - 1  # P(k) ~ 1/(k+1)
        return (rank * 2654435761 + table * 97) % rows

    def batch(self, size: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
        """``(dense (size, 13), sparse (tables, size, bag), labels (size,))``."""
        g = torch.Generator().manual_seed(seed)
        dense = torch.randn(size, DENSE_FEATURES, generator=g)
        sparse = torch.stack(
            [self.ids(t, (size, self.bag), g) for t in range(len(self.cardinalities))]
        )
        logit = self.logit(dense, sparse)
        labels = torch.bernoulli(torch.sigmoid(logit), generator=g)
        return dense, sparse, labels

    def logit(self, dense: Tensor, sparse: Tensor) -> Tensor:
        """The hidden model's click logit (what a perfect model would predict)."""
        g = torch.Generator().manual_seed(1234)  # the hidden model's own fixed weights
        tables = len(self.cardinalities)
        w = torch.randn(DENSE_FEATURES, generator=g) * 1.5 / math.sqrt(DENSE_FEATURES)
        a = torch.randn(tables, generator=g) * 0.25
        logit = dense @ w + self.bias
        factors = []
        for t in range(tables):
            ids = sparse[t]
            logit = logit + a[t] * _hash_unit(ids, 7 * t).mean(1)
            v = torch.stack([_hash_unit(ids, 1000 + 31 * t + k) for k in range(self.factors)])
            factors.append(v.mean(2).T)  # (batch, factors)
        f = torch.stack(factors, dim=1)  # (batch, tables, factors)
        pair = (f.sum(1).pow(2).sum(1) - f.pow(2).sum((1, 2))) / 2  # sum over pairs s < t
        return logit + pair / math.sqrt(tables * (tables - 1) / 2)


def log_loss(logits: Tensor, labels: Tensor) -> float:
    return float(nn.functional.binary_cross_entropy_with_logits(logits, labels))


def auc(scores: Tensor, labels: Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney, ties counted half)."""
    order = torch.argsort(scores)
    ranks = torch.empty_like(scores, dtype=torch.float64)
    ranks[order] = torch.arange(1, scores.numel() + 1, dtype=torch.float64)
    # average the ranks of tied scores
    unique, inverse = torch.unique(scores, return_inverse=True)
    sums = torch.zeros(unique.numel(), dtype=torch.float64).index_add_(0, inverse, ranks)
    counts = torch.bincount(inverse, minlength=unique.numel()).double()
    ranks = (sums / counts)[inverse]
    positive = labels > 0.5
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        raise ValueError("AUC needs both clicks and non-clicks")
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))
