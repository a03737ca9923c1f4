"""Training-step time of one Linear layer: dense against CoLA, BTT and Monarch of equal size.

    python benchmarks/block_layers.py            # 384 -> 1024 and 1024 -> 384, 2048 rows
    python benchmarks/block_layers.py --quick    # fewer repeats

Each structured layer gets the size ``optimize`` would give it under ``--budget`` (a share
of the dense weight): CoLA's rank, BTT's rank and Monarch's block count from the same
counts the budget pass uses. A step is forward, backward and an AdamW step with
``param_groups(lr=1e-3)``, timed eager side by side in one process (median of repeats).
Ratios > 1 mean the row is faster than dense.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_results  # noqa: E402
from _timing import median_seconds, table  # noqa: E402

from comera_compile import BTTLinear, MonarchLinear  # noqa: E402
from comera_compile.formats import (  # noqa: E402
    btt_modes,
    btt_rank_for,
    monarch_blocks_for,
)
from comera_compile.nn import CoLALinear  # noqa: E402
from comera_compile.training import param_groups  # noqa: E402


def layers_at(fan_in: int, fan_out: int, share: float) -> dict[str, nn.Module]:
    """Dense and each structured format at ``share`` of the dense weight's parameters."""
    target = share * fan_in * fan_out
    cola_rank = max(1, int(target // (fan_in + fan_out)))
    ins, outs = btt_modes(fan_in, fan_out)
    btt_rank = max(1, btt_rank_for(ins, outs, target))
    blocks = monarch_blocks_for(fan_in, fan_out, target)
    return {
        "dense": nn.Linear(fan_in, fan_out),
        f"cola r={cola_rank}": CoLALinear(fan_in, fan_out, ranks=cola_rank),
        f"btt r={btt_rank}": BTTLinear(fan_in, fan_out, ranks=btt_rank),
        f"monarch b={blocks}": MonarchLinear(fan_in, fan_out, blocks=blocks),
    }


def train_step(layer: nn.Module, x: torch.Tensor):
    """A closure: forward, backward (the output gradient made once) and an AdamW step."""
    opt = torch.optim.AdamW(param_groups(layer, lr=1e-3))
    grad = torch.ones(x.shape[0], layer.out_features)

    def run() -> None:
        opt.zero_grad(set_to_none=True)
        layer(x).backward(grad)
        opt.step()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--rows", type=int, default=2048, help="input rows per step")
    parser.add_argument("--budget", type=float, default=0.25, help="share of dense params")
    args = parser.parse_args()
    repeats = 5 if args.quick else 15
    torch.manual_seed(0)
    rows = []
    for fan_in, fan_out in [(384, 1024), (1024, 384)]:
        x = torch.randn(args.rows, fan_in)
        timed = {}
        for name, layer in layers_at(fan_in, fan_out, args.budget).items():
            timed[name] = (layer, median_seconds(train_step(layer, x), repeats))
        dense_s = timed["dense"][1]
        for name, (layer, seconds) in timed.items():
            params = sum(p.numel() for p in layer.parameters())
            rows.append([f"{fan_in}->{fan_out}", name, f"{params:,}", f"{seconds * 1e3:.1f}",
                         f"{dense_s / seconds:.2f}x"])
    header = ["shape", "layer", "params", "step ms", "vs dense"]
    text = table(rows, header)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rows} rows, "
          f"budget {args.budget:g} of the dense weight; forward + backward + AdamW, median\n")
    print(text)
    body = (f"{args.rows} rows, structured layers at {args.budget:g} of the dense weight's "
            "parameters; one training step (forward, backward, AdamW), eager, median of "
            f"{repeats}. Ratios > 1: faster than dense.\n\n```\n{text}\n```\n")
    path = write_results("block_layers", "Training step of one layer: dense, CoLA, BTT, "
                         "Monarch", body)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
