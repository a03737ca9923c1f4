"""A language model's token table compressed from scratch: the factorized layout ``A B`` that
``optimize`` gives it against the default TT chain at equal parameters, and the dense table.

Two parts, side by side in one process:

- **lookup**: forward + backward of one batch of token ids through the table alone (LLaMA-60M's
  32000 x 512 table, 16 x 256 ids), the median of ``--repeats`` after two warm-up calls; the
  chain also as bond recomputation runs it (its lookup rebuilt in backward).
- **quality**: a small LLaMA (width 256, 2 layers, vocabulary 4096) trained for ``--steps``
  AdamW steps on a synthetic bigram chain (each token has 8 successors, Zipf-weighted), dense
  and at budget 0.25 with the factorized table or the chain (``layer_config`` order 4); the
  held-out loss on 4 unseen batches. Synthetic data: it says whether the layout can learn a
  token-to-token map, not how it fares on text.

    python benchmarks/token_table.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import comera_compile as cc
from comera_compile.nn import TTEmbedding

VOCAB, DIM, BATCH, SEQ = 32000, 512, 16, 256


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _chain_like(params: int) -> TTEmbedding:
    """The default 4-core chain at the largest rank within ``params`` parameters."""
    lo, hi = 1, 1024
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if _params(TTEmbedding(VOCAB, DIM, ranks=mid, order=4)) <= params \
            else (lo, mid - 1)
    return TTEmbedding(VOCAB, DIM, ranks=lo, order=4)


def _lookup_ms(table: nn.Module, ids: torch.Tensor, repeats: int) -> float:
    def once() -> None:
        out = table(ids)
        out.backward(torch.ones_like(out))

    for _ in range(2):
        once()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def lookup_rows(repeats: int) -> list[str]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    factorized = TTEmbedding(VOCAB, DIM, ranks=123, row_modes=(VOCAB, 1), col_modes=(1, DIM))
    chain = _chain_like(_params(factorized))
    dense_ms = _lookup_ms(nn.Embedding(VOCAB, DIM), ids, repeats)
    rows = [("dense nn.Embedding", VOCAB * DIM, dense_ms)]
    rows.append(("factorized A B (the default)", _params(factorized),
                 _lookup_ms(factorized, ids, repeats)))
    rows.append((f"TT chain {list(chain.row_modes)} x {list(chain.col_modes)}, ranks "
                 f"{chain.ranks[1:-1]}", _params(chain), _lookup_ms(chain, ids, repeats)))
    chain.recompute_lookup = True
    rows.append(("TT chain, recomputed in backward", _params(chain),
                 _lookup_ms(chain, ids, repeats)))
    lines = ["| table | parameters | forward + backward ms | vs dense |", "|---|---|---|---|"]
    lines += [f"| {name} | {p:,} | {ms:.1f} | {ms / dense_ms:.2f}x |" for name, p, ms in rows]
    return lines


def _bigram_batches(vocab: int, seq: int, batch: int):
    g = torch.Generator().manual_seed(0)
    successors = torch.randint(0, vocab, (vocab, 8), generator=g)
    weights = 1.0 / torch.arange(1, 9).float()

    def make(seed: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        x = torch.empty(batch, seq, dtype=torch.long)
        x[:, 0] = torch.randint(0, vocab, (batch,), generator=gen)
        for t in range(1, seq):
            pick = torch.multinomial(weights, batch, replacement=True, generator=gen)
            x[:, t] = successors[x[:, t - 1], pick]
        return x

    return make


def quality_rows(steps: int) -> list[str]:
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab, seq = 4096, 64
    batch = _bigram_batches(vocab, seq, 16)
    config = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=688,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=seq, tie_word_embeddings=False)
    variants = {"dense": None, "budget 0.25, factorized A B (the default)": {},
                "budget 0.25, TT chain (layer_config order 4)":
                    {"model.embed_tokens": {"order": 4}}}
    lines = ["| model | parameters | token table | train loss (last 20 steps) | held-out loss |",
             "|---|---|---|---|---|"]
    for name, layer_config in variants.items():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        if layer_config is not None:
            model = cc.optimize(model, cc.CompressionConfig(
                budget=0.25, compile=False, layer_config=layer_config or None),
                example_inputs=(batch(999),))
        table = model.get_input_embeddings()
        layout = (f"{list(table.row_modes)} x {list(table.col_modes)}"
                  if isinstance(table, TTEmbedding) else "dense")
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for step in range(steps):
            x = batch(step)
            loss = model(input_ids=x, labels=x).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        model.eval()
        with torch.no_grad():
            held = statistics.mean(
                model(input_ids=(x := batch(10_000 + i)), labels=x).loss.item() for i in range(4))
        lines.append(f"| {name} | {_params(model):,} | {layout} | "
                     f"{statistics.mean(losses[-20:]):.3f} | {held:.3f} |")
    return lines


def main() -> None:
    from _results import write_results  # benchmarks/: run as a script

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    body = "\n".join([
        f"{args.threads} threads.", "",
        f"**Lookup** of {BATCH} x {SEQ} ids in a {VOCAB} x {DIM} table, forward + backward, "
        f"median of {args.repeats}:", "", *lookup_rows(args.repeats), "",
        f"**Quality** on a synthetic bigram chain, {args.steps} AdamW steps at 3e-3, batch "
        "16 x 64, one seed:", "", *quality_rows(args.steps)])
    path = write_results("token_table", "A token table compressed from scratch", body)
    print(body)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
