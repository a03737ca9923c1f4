"""What rank adaptation adds to a training step: ``trainer.loss`` terms + ``trainer.step()``.

The model is the six-encoder classifier with the CoMERA paper's factorizations (37 TT
linears and a TTM embedding: 188 rank gates). Each round times, side by side:

- model step: forward, task loss, backward, ``optimizer.step()``;
- the same step with ``trainer.loss`` and ``trainer.step()``, in the early and the late
  stage (the late stage's soft size term is the dearer one);
- the bookkeeping alone: the rank terms, their backward, and ``trainer.step()``.

    PYTHONPATH=. python benchmarks/bookkeeping.py --batch 4 --seq 32 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import table  # noqa: E402

from comera_compile.cli.machine import describe_machine  # noqa: E402
from comera_compile.cli.pair_task import PairTask  # noqa: E402
from comera_compile.cli.six_encoder import SixEncoderConfig, reference_tensorized  # noqa: E402
from comera_compile.training import RankAdaptiveTrainer, param_groups  # noqa: E402


def clock() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=32, help="tokens per example")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--vocab", type=int, default=32000)
    args = p.parse_args()
    print(describe_machine())
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = reference_tensorized(SixEncoderConfig(vocab_size=args.vocab)).to(device)
    opt = torch.optim.AdamW(param_groups(model))
    trainer = RankAdaptiveTrainer(model, opt, early_steps=None, prune_every=None, history=False)
    gates = len(trainer.bank)
    task = PairTask(vocab_size=args.vocab, sentence_len=(args.seq - 3) // 2)
    ids, types, labels = (t.to(device) for t in task.batch(args.batch, torch.Generator()))

    def model_step(with_trainer: bool) -> None:
        loss = F.cross_entropy(model(ids, types), labels)
        if with_trainer:
            loss = trainer.loss(loss)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if with_trainer:
            trainer.step()

    def bookkeeping_only() -> None:
        weight, extra = trainer.rank_terms()
        extra.backward()
        trainer._pending = {"task_loss": extra.detach()}
        trainer.step()

    def measure(stage: str) -> dict[str, float]:
        times: dict[str, list[float]] = {"model": [], "with": [], "alone": []}
        for _ in tqdm(range(args.rounds), desc=f"{stage} stage", leave=False):
            for name, fn in (
                ("model", lambda: model_step(False)),
                ("with", lambda: model_step(True)),
                ("alone", bookkeeping_only),
            ):
                start = clock()
                fn()
                times[name].append(clock() - start)
        return {k: statistics.median(v) for k, v in times.items()}

    for _ in range(2):  # warm-up: allocator, plans
        model_step(True)
    early = measure("early")
    trainer.start_late_stage()
    model_step(True)
    late = measure("late")

    rows = []
    for stage, t in (("early", early), ("late", late)):
        rows.append(
            [
                stage,
                f"{1e3 * t['model']:.1f}",
                f"{1e3 * t['with']:.1f}",
                f"{1e3 * t['alone']:.2f}",
                f"{100 * t['alone'] / t['model']:.2f}%",
                f"{100 * (t['with'] - t['model']) / t['model']:+.1f}%",
            ]
        )
    print(
        f"six-encoder (paper factorizations, {gates} rank gates), batch {args.batch} x "
        f"{args.seq} tokens, {args.rounds} rounds, medians"
    )
    header = ["stage", "model step ms", "with trainer ms", "bookkeeping ms", "overhead", "A/B"]
    print(table(rows, header))
    print("overhead: bookkeeping alone / model step; A/B: step with trainer vs without (noisier)")


if __name__ == "__main__":
    main()
