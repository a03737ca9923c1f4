"""Learning-rate transfer over width: does the best rate stay put as the model widens?

``param_groups(model, lr=...)`` promises that the one rate a user would give the dense
model suits the compressed one, at any width (each core's rate follows from its fan-in,
muP extended to structured layers). muP's own check is a width sweep: train the same
architecture at several widths over a grid of rates and see whether the best rate moves.
This script does that for Hugging Face LLaMA models from configs (2 layers, head width 64,
byte vocabulary) pretrained from scratch on the same corpus as ``pretrain.py``, with
``optimize``'s default format at the given budget, and, for reference, for the dense model
under plain AdamW (standard parametrization, whose best rate is expected to fall with
width). It prints held-out bits per byte per width and rate, and the best rate per width.

    python benchmarks/lr_sweep.py --widths 128,256,512 --lrs 3e-4,1e-3,3e-3,1e-2 --steps 120
"""

from __future__ import annotations

import argparse
import math
import sys
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_results  # noqa: E402
from pretrain import batch, evaluate, llama, load_corpus, schedule  # noqa: E402

import comera_compile as cc  # noqa: E402
from comera_compile.tables import text_table  # noqa: E402


def train_once(args, width: int, lr: float, compressed: bool, data) -> float:
    """Val bpb after ``args.steps`` steps of one width and rate (same seed, same batches)."""
    train, val_batches = data
    torch.manual_seed(args.seed)
    ffn = round(width * 8 / 3 / 8) * 8
    model = llama(width, ffn, args.layers, max(1, width // 64), args.seq)
    if compressed:
        example = (torch.zeros(args.batch, args.seq, dtype=torch.long),)
        model = cc.optimize(model, budget=args.budget, example_inputs=example, compile=False)
        groups = cc.training.param_groups(model, lr=lr)
    else:
        groups = model.parameters()
    optimizer = torch.optim.AdamW(groups, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    base = [g["lr"] for g in optimizer.param_groups]
    gen = torch.Generator().manual_seed(args.seed + 2)
    for step in range(args.steps):
        xb = batch(train, args.batch, args.seq, gen)
        for group, rate in zip(optimizer.param_groups, base):
            group["lr"] = rate * schedule(step, args.warmup, args.steps)
        logits = model(xb[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, 256), xb[:, 1:].reshape(-1))
        if not math.isfinite(loss.item()):
            return float("inf")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return evaluate(model, val_batches)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--widths", default="128,256,512")
    p.add_argument("--lrs", default="3e-4,1e-3,3e-3,1e-2")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--warmup", type=int, default=12)
    p.add_argument("--budget", type=float, default=0.25)
    p.add_argument("--corpus", default=sysconfig.get_paths()["stdlib"])
    p.add_argument("--corpus-bytes", type=int, default=4_000_000)
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    widths = [int(w) for w in args.widths.split(",")]
    lrs = [float(r) for r in args.lrs.split(",")]
    train, val = load_corpus(Path(args.corpus), args.corpus_bytes)
    gen = torch.Generator().manual_seed(args.seed + 1)
    data = (train, [batch(val, args.batch, args.seq, gen) for _ in range(args.val_batches)])
    rows, best = [], {}
    for kind, compressed in (("default format", True), ("dense", False)):
        for width in widths:
            values = [train_once(args, width, lr, compressed, data) for lr in lrs]
            best[kind, width] = lrs[min(range(len(lrs)), key=values.__getitem__)]
            rows.append([kind, str(width), *(f"{v:.3f}" for v in values),
                         f"{best[kind, width]:g}"])
            print(rows[-1], flush=True)
    header = ["model", "width", *(f"lr {r:g}" for r in lrs), "best lr"]
    text = text_table(header, rows, right=range(1, len(header)))
    lines = []
    for kind in ("default format", "dense"):
        moves = [best[kind, w] for w in widths]
        lines.append(f"{kind}: best lr over widths {widths}: {moves} ("
                     + ("stays put" if len(set(moves)) == 1 else
                        f"moves {max(moves) / min(moves):g}x") + ")")
    text += "\n\n" + "\n".join(lines)
    print(text)
    setup = (f"LlamaForCausalLM {args.layers} layers, head width 64, FFN 8/3 x width, byte "
             f"vocabulary, sequence {args.seq}, batch {args.batch}, {args.steps} AdamW steps "
             f"({args.warmup} warm-up, cosine); compressed: optimize(budget={args.budget}) "
             f"with defaults and param_groups(model, lr); dense: AdamW(lr); held-out bits "
             f"per byte on {args.corpus}.")
    if not args.no_write:
        print("wrote", write_results("lr_sweep", "Learning-rate transfer over width",
                                     setup + "\n\n```\n" + text + "\n```\n"))


if __name__ == "__main__":
    main()
