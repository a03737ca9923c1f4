"""Small test models: an MLP, a CNN with a Linear head, and a DLRM-style recommender."""

from __future__ import annotations

import torch
from dlrm_model import DLRM
from torch import Tensor, nn


class MLP(nn.Module):
    def __init__(self, sizes=(256, 512, 256, 10)) -> None:
        super().__init__()
        layers = []
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(nn.Linear(a, b))
            if i < len(sizes) - 2:
                layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class SmallCNN(nn.Module):
    """Two conv blocks, then a 1024 -> 256 -> 10 Linear head on 3x32x32 images."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.fc = nn.Linear(16 * 8 * 8, 256)
        self.head = nn.Linear(256, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.features(x).flatten(1)
        return self.head(torch.relu(self.fc(x)))


def small_dlrm(tables=(20000, 1000, 500), dim: int = 32, sparse: bool = False) -> DLRM:
    """The one DLRM (``examples/dlrm_model.py``) at test size: a few EmbeddingBag tables
    (one large, as in recommendation models), one hidden layer in each MLP."""
    return DLRM(tables, dim=dim, bottom=(128,), top=(256,), sparse=sparse)


def dlrm_batch(model: DLRM, batch: int = 8, bag: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(batch, 13, generator=g)
    sparse = torch.stack(
        [torch.randint(0, t.num_embeddings, (batch, bag), generator=g) for t in model.tables]
    )
    return dense, sparse


def small_tt_model(seed: int = 0) -> nn.Module:
    """Two small TT layers in float64: the rank-adaptive trainer's test model."""
    from comera_compile.nn import TTLinear

    torch.manual_seed(seed)
    return nn.Sequential(
        TTLinear(16, 12, ranks=4, in_modes=[4, 4], out_modes=[3, 4]),
        nn.Tanh(),
        TTLinear(12, 3, ranks=3, in_modes=[3, 4], out_modes=[1, 3]),
    ).double()


def toy_classes(n: int, seed: int = 1) -> tuple[Tensor, Tensor]:
    """``n`` float64 inputs of width 16, labelled by which of the first 3 features is largest."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g, dtype=torch.float64)
    return x, x[:, :3].argmax(1)


def train_steps(model, opt, trainer, x: Tensor, y: Tensor, steps: int) -> None:
    """``steps`` of the plain rank-adaptive loop: task loss + rank loss, backward, step."""
    for _ in range(steps):
        loss = trainer.loss(torch.nn.functional.cross_entropy(model(x), y))
        opt.zero_grad()
        loss.backward()
        opt.step()
        trainer.step()


def assert_compiled_gradients_match_eager(model: nn.Module, x: Tensor) -> None:
    """One backward of ``model(x).square().mean()`` in eager, then through the comera backend
    with inductor's caches off (so every graph pass runs); the gradients must agree."""
    torch._dynamo.reset()
    model(x).square().mean().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with torch._inductor.config.patch(force_disable_caches=True):
        torch.compile(model, backend="comera")(x).square().mean().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)
    torch._dynamo.reset()
