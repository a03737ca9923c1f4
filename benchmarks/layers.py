"""Forward + backward time of dense layers against their tensorized replacements, side by side.

    python benchmarks/layers.py            # full grid (a few minutes on 2 CPU cores)
    python benchmarks/layers.py --quick    # fewer repeats

Linear: nn.Linear vs TTLinear vs TTMLinear at 768x768 and 768x3072, ranks 16 / 30, batch
(rows of input) 32 / 512 / 4096. Embedding: nn.Embedding vs TTEmbedding, 32000 x 768,
rank 32, 4096 ids drawn Zipf-like (as in text) and uniformly. Ratios > 1 mean ours is faster.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import forward_backward, median_seconds, table  # noqa: E402

from comera_compile import TTEmbedding, TTLinear, TTMLinear  # noqa: E402


def linear_rows(repeats: int) -> list[list[str]]:
    rows = []
    for fan_in, fan_out in [(768, 768), (768, 3072)]:
        dense = nn.Linear(fan_in, fan_out)
        for rank in (16, 30):
            tt = TTLinear(fan_in, fan_out, ranks=rank)
            ttm = TTMLinear(fan_in, fan_out, ranks=rank)
            for batch in (32, 512, 4096):
                x = torch.randn(batch, fan_in)
                t_dense = median_seconds(forward_backward(dense, (x,)), repeats)
                t_tt = median_seconds(forward_backward(tt, (x,)), repeats)
                t_ttm = median_seconds(forward_backward(ttm, (x,)), repeats)
                rows.append([
                    f"{fan_in}x{fan_out}", rank, batch,
                    f"{t_dense * 1e3:.2f}", f"{t_tt * 1e3:.2f}", f"{t_ttm * 1e3:.2f}",
                    f"{t_dense / t_tt:.2f}x", f"{t_dense / t_ttm:.2f}x",
                    f"{dense.weight.numel() / sum(c.numel() for c in tt.cores):.0f}x",
                ])
    return rows


def zipf_ids(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """Ids with the rank-frequency law of natural text (Zipf, exponent ~1.1)."""
    rng = np.random.default_rng(seed)
    ids = rng.zipf(1.1, size=4 * n)
    ids = ids[ids <= vocab][:n] - 1
    perm = rng.permutation(vocab)  # frequent ids are not the small ones
    return torch.from_numpy(perm[ids]).long()


def embedding_rows(repeats: int) -> list[list[str]]:
    vocab, dim, n = 32000, 768, 4096
    dense = nn.Embedding(vocab, dim)
    tt = TTEmbedding(vocab, dim, ranks=32)
    rows = []
    for name, ids in [("zipf", zipf_ids(n, vocab)), ("uniform", torch.randint(0, vocab, (n,)))]:
        t_dense = median_seconds(forward_backward(dense, (ids,)), repeats)
        t_tt = median_seconds(forward_backward(tt, (ids,)), repeats)
        rows.append([
            name, len(torch.unique(ids)), f"{t_dense * 1e3:.2f}", f"{t_tt * 1e3:.2f}",
            f"{t_dense / t_tt:.2f}x",
            f"{dense.weight.numel() / sum(c.numel() for c in tt.cores):.0f}x",
        ])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args()
    repeats = 3 if args.quick else 10
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, times in ms "
          "(forward + backward, median)\n")
    print(table(linear_rows(repeats), [
        "shape", "rank", "rows", "nn.Linear", "TTLinear", "TTMLinear",
        "TT speed-up", "TTM speed-up", "TT compression",
    ]))
    print()
    print(table(embedding_rows(repeats), [
        "ids", "unique", "nn.Embedding", "TTEmbedding", "speed-up", "compression",
    ]))


if __name__ == "__main__":
    main()
