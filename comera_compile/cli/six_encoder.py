"""The six-encoder BERT-like classifier of the CoMERA MNLI experiment (arXiv 2405.14377)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from comera_compile.nn import TTEmbedding, TTLinear


@dataclass
class SixEncoderConfig:
    vocab_size: int = 32000
    hidden: int = 768
    layers: int = 6
    heads: int = 12
    ffn: int = 3072
    max_position: int = 512
    type_vocab: int = 2
    num_labels: int = 3
    dropout: float = 0.1


class SelfAttention(nn.Module):
    def __init__(self, config: SixEncoderConfig) -> None:
        super().__init__()
        if config.hidden % config.heads:
            raise ValueError(f"hidden {config.hidden} is not divisible by heads {config.heads}")
        self.heads = config.heads
        self.query = nn.Linear(config.hidden, config.hidden)
        self.key = nn.Linear(config.hidden, config.hidden)
        self.value = nn.Linear(config.hidden, config.hidden)
        self.out = nn.Linear(config.hidden, config.hidden)
        self.dropout = config.dropout

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        b, t, c = x.shape
        q, k, v = (proj(x).view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for proj in (self.query, self.key, self.value))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        return self.out(y.transpose(1, 2).reshape(b, t, c))


class FeedForward(nn.Module):
    def __init__(self, config: SixEncoderConfig) -> None:
        super().__init__()
        self.fc_in = nn.Linear(config.hidden, config.ffn)
        self.fc_out = nn.Linear(config.ffn, config.hidden)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc_out(F.gelu(self.fc_in(x)))


class EncoderLayer(nn.Module):
    """Post-LayerNorm encoder block, as in BERT and the reference."""

    def __init__(self, config: SixEncoderConfig) -> None:
        super().__init__()
        self.attention = SelfAttention(config)
        self.ln_attention = nn.LayerNorm(config.hidden)
        self.ffn = FeedForward(config)
        self.ln_ffn = nn.LayerNorm(config.hidden)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        x = self.ln_attention(x + self.drop(self.attention(x, mask)))
        return self.ln_ffn(x + self.drop(self.ffn(x)))


class SixEncoderClassifier(nn.Module):
    """Embeddings -> encoder layers -> ``CLS -> fc1 -> tanh -> fc2`` classifier."""

    def __init__(self, config: SixEncoderConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or SixEncoderConfig()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden)
        self.position_embeddings = nn.Embedding(config.max_position, config.hidden)
        self.token_type_embeddings = nn.Embedding(config.type_vocab, config.hidden)
        self.ln_embeddings = nn.LayerNorm(config.hidden)
        self.drop = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.layers))
        self.fc1 = nn.Linear(config.hidden, config.hidden)
        self.fc2 = nn.Linear(config.hidden, config.num_labels)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None = None,
                attention_mask: Tensor | None = None) -> Tensor:
        t = input_ids.shape[1]
        positions = torch.arange(t, device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        if token_type_ids is not None:
            x = x + self.token_type_embeddings(token_type_ids)
        x = self.drop(self.ln_embeddings(x))
        mask = None
        if attention_mask is not None:  # (b, t) of 1 = token, 0 = padding
            mask = attention_mask[:, None, None, :].to(torch.bool)
        for layer in self.layers:
            x = layer(x, mask)
        return self.fc2(torch.tanh(self.fc1(x[:, 0])))


def reference_tensorized(config: SixEncoderConfig | None = None, max_rank: int = 30,
                         embedding_rank: int = 32) -> SixEncoderClassifier:
    """The model with the CoMERA paper's factorizations (768-wide sizes only)."""
    config = config or SixEncoderConfig()
    if (config.hidden, config.ffn) != (768, 3072) or config.vocab_size > 32000:
        raise ValueError("CoMERA's factorizations are for hidden 768, ffn 3072, vocab<=32000")
    model = SixEncoderClassifier(config)
    square = {"in_modes": [12, 8, 8], "out_modes": [8, 8, 12], "ranks": max_rank}
    for layer in model.layers:
        for name in ("query", "key", "value", "out"):
            setattr(layer.attention, name, TTLinear(768, 768, **square))
        layer.ffn.fc_in = TTLinear(
            768, 3072, ranks=max_rank, in_modes=[12, 8, 8], out_modes=[12, 16, 16]
        )
        layer.ffn.fc_out = TTLinear(
            3072, 768, ranks=max_rank, in_modes=[16, 16, 12], out_modes=[8, 8, 12]
        )
    model.fc1 = TTLinear(768, 768, **square)
    model.word_embeddings = TTEmbedding(config.vocab_size, 768, ranks=embedding_rank,
                                        row_modes=[16, 20, 10, 10], col_modes=[4, 4, 8, 6])
    return model
