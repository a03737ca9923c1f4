"""CoMERA on the six-encoder classifier of the MNLI experiment, shortened to run in minutes.

The model is ``comera_compile.cli.six_encoder`` (post-LN BERT-like encoder, CLS ->
fc1 -> tanh -> fc2). We train it dense and tensorized (every encoder Linear and fc1 as
TTLinear, the word embedding as TTEmbedding; the CoMERA paper's factorizations when the
size is the paper's 768 / 3072) for the same number of steps; the tensorized one goes through
CoMERA's early stage, then a late stage towards ``--target-ratio`` of its size.

Data: by default the synthetic sentence-pair problem of
``comera_compile.cli.pair_task`` (the label compares how many "marked" words each
sentence holds, so the answer needs attention across the pair).
With ``--mnli DIR`` it reads GLUE's ``train.tsv`` and ``dev_matched.tsv`` from disk
(nothing is downloaded). Words are lower-cased, split on ``\\w+|[^\\w\\s]`` and hashed
(crc32) into the vocabulary: no wordpieces, collisions accepted.

    python examples/six_encoder.py                       # small, a few minutes on a CPU
    python examples/six_encoder.py --hidden 768 --layers 6 --heads 12 --ffn 3072 --mnli glue/MNLI

The run is deterministic for a given seed and thread count (see ``--threads``).
"""

from __future__ import annotations

import argparse
import copy
import csv
import re
import time
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from comera_compile.cli.machine import describe_machine, reproducible
from comera_compile.cli.pair_task import PairTask
from comera_compile.cli.six_encoder import (
    SixEncoderClassifier,
    SixEncoderConfig,
    reference_tensorized,
)
from comera_compile.nn import TTEmbedding, TTLinear
from comera_compile.training import (
    RankAdaptiveTrainer,
    model_size,
    param_groups,
    plot_compression,
    plot_ranks,
    tensorized_compression,
)

CLS, SEP, PAD = 0, 1, 2  # as in PairTask
FIRST_WORD = 3
LABELS = {"entailment": 0, "neutral": 1, "contradiction": 2}


# ----- data --------------------------------------------------------------------------------
def pair_batch(ids_a: list[list[int]], ids_b: list[list[int]], max_len: int) -> tuple[Tensor, ...]:
    """``[CLS] a [SEP] b [SEP]`` rows with token types and an attention mask, padded."""
    rows, types = [], []
    for a, b in zip(ids_a, ids_b):
        a = a[: max_len // 2 - 2]
        b = b[: max_len - len(a) - 3]
        rows.append([CLS, *a, SEP, *b, SEP])
        types.append([0] * (len(a) + 2) + [1] * (len(b) + 1))
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [PAD] * (width - len(r)) for r in rows])
    tt = torch.tensor([t + [0] * (width - len(t)) for t in types])
    return ids, tt, (ids != PAD).long()


def synthetic(n: int, vocab: int, seed: int):
    """``n`` examples of :class:`PairTask` as premise / hypothesis word lists."""
    task = PairTask(vocab_size=vocab)
    ids, _, labels = task.batch(n, torch.Generator().manual_seed(seed))
    length = task.sentence_len
    premise = ids[:, 1 : length + 1].tolist()
    hypothesis = ids[:, length + 2 : 2 * length + 2].tolist()
    return premise, hypothesis, labels


def hash_words(text: str, vocab: int) -> list[int]:
    words = re.findall(r"\w+|[^\w\s]", text.lower())
    return [FIRST_WORD + zlib.crc32(w.encode()) % (vocab - FIRST_WORD) for w in words]


def read_mnli(path: Path, vocab: int, limit: int | None):
    a_rows, b_rows, labels = [], [], []
    with path.open(newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE):
            if row.get("gold_label") not in LABELS:
                continue
            a_rows.append(hash_words(row["sentence1"], vocab))
            b_rows.append(hash_words(row["sentence2"], vocab))
            labels.append(LABELS[row["gold_label"]])
            if limit and len(labels) >= limit:
                break
    return a_rows, b_rows, torch.tensor(labels)


class PairData:
    """Examples held as token lists; batches are built (and padded) on demand."""

    def __init__(self, a_rows, b_rows, labels: Tensor, max_len: int) -> None:
        self.a, self.b, self.labels, self.max_len = a_rows, b_rows, labels, max_len

    def __len__(self) -> int:
        return len(self.labels)

    def batch(self, index: Tensor) -> tuple[Tensor, ...]:
        idx = index.tolist()
        ids, types, mask = pair_batch(
            [self.a[i] for i in idx], [self.b[i] for i in idx], self.max_len
        )
        return ids, types, mask, self.labels[index]


def batches(n: int, batch: int, steps: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    done = 0
    while True:
        for index in torch.randperm(n, generator=g).split(batch):
            if done == steps:
                return
            yield index
            done += 1


# ----- models ------------------------------------------------------------------------------
def tensorized(config: SixEncoderConfig, rank: int, embedding_rank: int) -> SixEncoderClassifier:
    """Every encoder Linear and fc1 as TTLinear, the word table as TTEmbedding."""
    if (config.hidden, config.ffn) == (768, 3072):
        return reference_tensorized(config, max_rank=rank, embedding_rank=embedding_rank)
    model = SixEncoderClassifier(config)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, child in linears:
        if name != "fc2":  # the 3-way classifier stays dense, as in the reference
            parent, _, attr = name.rpartition(".")
            tt = TTLinear(child.in_features, child.out_features, ranks=rank)
            setattr(model.get_submodule(parent), attr, tt)
    model.word_embeddings = TTEmbedding(config.vocab_size, config.hidden, ranks=embedding_rank)
    return model


def accuracy(model: nn.Module, data: PairData, batch: int = 256) -> float:
    model.eval()
    correct = 0
    with torch.no_grad():
        for index in torch.arange(len(data)).split(batch):
            ids, types, mask, y = data.batch(index)
            correct += int((model(ids, types, mask).argmax(1) == y).sum())
    model.train()
    return 100 * correct / len(data)


def step_time(model: nn.Module, batch: tuple[Tensor, ...], repeats: int = 5) -> float:
    """Mean seconds of forward + backward on one batch (gradients thrown away)."""
    ids, types, mask, y = batch
    F.cross_entropy(model(ids, types, mask), y).backward()  # warm-up: plans, allocations
    start = time.perf_counter()
    for _ in range(repeats):
        F.cross_entropy(model(ids, types, mask), y).backward()
    model.zero_grad(set_to_none=True)
    return (time.perf_counter() - start) / repeats


def train(model, data: PairData, args, trainer_opts: dict | None = None, test=None):
    torch.manual_seed(args.seed)
    if trainer_opts is None:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
        trainer = None
    else:
        groups = param_groups(
            model, lr_cores=args.lr_cores, lr_gates=args.lr_gates, lr_rest=args.lr
        )
        opt = torch.optim.AdamW(groups)
        trainer = RankAdaptiveTrainer(model, opt, **trainer_opts)
    name = "dense " if trainer is None else "CoMERA"
    stream = batches(len(data), args.batch, args.steps, args.seed)
    bar = tqdm(stream, total=args.steps, desc=name, unit="step", ncols=99, mininterval=1.0)
    for step, index in enumerate(bar, 1):
        ids, types, mask, y = data.batch(index)
        loss = F.cross_entropy(model(ids, types, mask), y)
        if trainer is not None:
            loss = trainer.loss(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if trainer is not None:
            trainer.step()
        if step % args.log_every == 0:
            stage = f" {trainer.stage:5s} size {model_size(model):>9,d}" if trainer else ""
            acc = f" test acc {accuracy(model, test):5.1f}%" if test is not None else ""
            bar.write(f"  step {step:5d} loss {loss.item():.4f}{stage}{acc}")
    if trainer is not None:
        trainer.prune()
    return trainer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--early-steps", type=int, default=None, help="default: half of --steps")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--rank", type=int, default=24)
    p.add_argument("--embedding-rank", type=int, default=16)
    p.add_argument("--target-ratio", type=float, default=0.5)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--lr-cores", type=float, default=1e-3)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--lr-gates", type=float, default=6e-3)
    p.add_argument("--train-size", type=int, default=40000)
    p.add_argument("--mnli", type=Path, default=None, help="folder with GLUE MNLI TSV files")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=200)
    p.add_argument("--out", type=Path, default=Path("runs/six_encoder"))
    p.add_argument("--threads", type=int, default=1, help="fixed so that the numbers repeat")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)  # a bad folder fails before training
    with reproducible(args.seed, args.threads):
        print(describe_machine())
        run(args)


def run(args: argparse.Namespace) -> None:

    if args.mnli is not None:
        vocab = max(args.vocab, 32000)
        train_set = PairData(
            *read_mnli(args.mnli / "train.tsv", vocab, args.train_size), args.max_len
        )
        test_set = PairData(*read_mnli(args.mnli / "dev_matched.tsv", vocab, None), args.max_len)
    else:
        vocab = args.vocab
        train_set = PairData(*synthetic(args.train_size, vocab, args.seed), args.max_len)
        test_set = PairData(*synthetic(1500, vocab, args.seed + 1), args.max_len)
    config = SixEncoderConfig(
        vocab_size=vocab,
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        ffn=args.ffn,
        max_position=max(args.max_len, 16),
        dropout=args.dropout,
    )
    early = args.early_steps if args.early_steps is not None else args.steps // 2
    probe = train_set.batch(torch.arange(args.batch))

    print(f"dense: {args.layers} layers, hidden {args.hidden}, {args.steps} steps")
    torch.manual_seed(args.seed)
    dense = SixEncoderClassifier(config)
    start = time.perf_counter()
    train(dense, train_set, args, test=test_set)
    dense_s, dense_acc = time.perf_counter() - start, accuracy(dense, test_set)
    dense_step = step_time(dense, probe)

    print(f"CoMERA: early stage {early} steps, then late stage to {args.target_ratio:.0%}")
    torch.manual_seed(args.seed)
    model = tensorized(config, args.rank, args.embedding_rank)
    before_step = step_time(copy.deepcopy(model), probe)
    start = time.perf_counter()
    opts = dict(
        target_ratio=args.target_ratio,
        early_steps=early,
        prune_every=25,
        l2_weight=1e-4,
        task_target=0.1,
    )
    trainer = train(model, train_set, args, opts, test=test_set)
    tt_s, tt_acc = time.perf_counter() - start, accuracy(model, test_set)
    after_step = step_time(model, probe)

    size_end = trainer.size()
    print()
    print(
        f"dense   accuracy {dense_acc:6.2f}%  params {model_size(dense):>10,d}  ({dense_s:.0f} s)"
    )
    print(f"CoMERA  accuracy {tt_acc:6.2f}%  params {size_end:>10,d}  ({tt_s:.0f} s)")
    print(f"accuracy gap     {dense_acc - tt_acc:+6.2f} points")
    print(
        f"late stage: size {trainer.size_start:,d} -> {size_end:,d}, target "
        f"{trainer.size_target:,.0f} ({args.target_ratio:.0%}): reached {trainer.target_reached}"
    )
    print(
        f"tensorized layers: {tensorized_compression(model):.1f}x smaller than their dense weights"
    )
    print(
        f"forward+backward per batch of {args.batch}: dense {1e3 * dense_step:.1f} ms, "
        f"TT before pruning {1e3 * before_step:.1f} ms, after {1e3 * after_step:.1f} ms"
    )
    trainer.history.to_csv(args.out / "history.csv")
    print(f"saved {plot_ranks(trainer.history, args.out / 'ranks.png')}")
    print(f"saved {plot_compression(trainer.history, args.out / 'compression.png')}")


if __name__ == "__main__":
    main()
