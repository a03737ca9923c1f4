"""The MiniLM recovery data and score: stdlib sentences, masked mean pooling, cosine."""

from types import SimpleNamespace

import torch
from minilm_corpus import embedding_cosine, sentence_embedding, stdlib_sentences


def test_stdlib_sentences_are_deterministic_filtered_and_unique():
    first, again = stdlib_sentences(seed=0), stdlib_sentences(seed=0)
    assert first == again and len(first) > 1000
    assert len(set(first)) == len(first)
    assert all(40 <= len(s) <= 300 and "\n" not in s for s in first)
    assert stdlib_sentences(seed=1)[:50] != first[:50]  # the seed shuffles
    assert stdlib_sentences(limit=10) == first[:10]


def test_sentence_embedding_ignores_padding_and_has_unit_length():
    hidden = torch.randn(2, 5, 8)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    padded = hidden.clone()
    padded[0, 3:] = 100.0  # padding positions must not count
    out = sentence_embedding(SimpleNamespace(last_hidden_state=padded), {"attention_mask": mask})
    want = torch.nn.functional.normalize(hidden[0, :3].mean(0), dim=-1)
    torch.testing.assert_close(out[0], want)
    torch.testing.assert_close(out.norm(dim=-1), torch.ones(2))


def test_embedding_cosine_is_one_for_the_same_model_and_lower_for_another():
    class Encoder(torch.nn.Module):
        def __init__(self, seed: int) -> None:
            super().__init__()
            torch.manual_seed(seed)
            self.embed = torch.nn.Embedding(50, 16)

        def forward(self, input_ids, attention_mask):
            return SimpleNamespace(last_hidden_state=self.embed(input_ids))

    batches = [{"input_ids": torch.randint(0, 50, (4, 7)),
                "attention_mask": torch.ones(4, 7, dtype=torch.long)}]
    a, b = Encoder(0), Encoder(1)
    assert abs(embedding_cosine(a, a, batches) - 1.0) < 1e-5
    assert embedding_cosine(a, b, batches) < 0.9


def test_package_sentences_are_another_source_and_deterministic():
    from minilm_corpus import package_sentences

    stdlib = set(stdlib_sentences())
    first = package_sentences(seed=0, exclude=stdlib)
    assert first == package_sentences(seed=0, exclude=stdlib) and len(first) > 100
    assert not stdlib & set(first)  # the two corpora are kept apart
    assert all(40 <= len(s) <= 300 and "\n" not in s and "http" not in s for s in first)
