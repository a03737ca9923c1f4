"""A tensorized embedding tied to the LM head shares its cores with the head: logits are a
planned contraction h @ E^T of the same cores, the tie survives training, pruning and a
checkpoint round trip, and the summary says so."""

import torch
import torch.nn.functional as F
from torch import nn

import comera_compile as cc
from comera_compile.nn import TiedEmbeddingHead, TTEmbedding


class TinyLM(nn.Module):
    def __init__(self, vocab=2048, dim=64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mix(self.embed(ids))))


def test_tied_head_reads_the_embedding_cores(tmp_path):
    torch.manual_seed(0)
    base = TinyLM()
    ids = torch.randint(0, 2048, (4, 9))
    model = cc.optimize(base, 0.1, compile=False)
    assert isinstance(model.embed, TTEmbedding) and isinstance(model.head, TiedEmbeddingHead)
    assert model.head.embedding is model.embed
    assert sum(p.numel() for p in model.head.parameters()) == 0
    assert sum(p.numel() for p in model.parameters()) <= 0.1 * sum(
        p.numel() for p in base.parameters())
    h = torch.randn(4, 9, 64)
    with torch.no_grad():
        torch.testing.assert_close(model.head(h), h @ model.embed.to_dense().T,
                                   rtol=1e-4, atol=1e-5)
    assert "tied: head computes its logits from the cores of embed" in str(cc.summary(model))

    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(3):
        loss = F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    with torch.no_grad():
        model.embed.gates[0][:2] = 0.0
    assert model.embed.prune_ranks()
    with torch.no_grad():
        torch.testing.assert_close(model.head(h), h @ model.embed.to_dense().T,
                                   rtol=1e-4, atol=1e-5)
        expected = model(ids)
    cc.save(model, tmp_path)
    loaded = cc.load(tmp_path, model=TinyLM())
    assert loaded.head.embedding is loaded.embed
    with torch.no_grad():
        assert torch.equal(loaded(ids), expected)
