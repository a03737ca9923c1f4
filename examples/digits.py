"""CoMERA on scikit-learn's digits: a TT-compressed MLP that matches its dense twin.

The 8x8 digit images (1797 of them, bundled with scikit-learn, no download) feed a
64 -> 512 -> 512 -> 10 MLP (hidden width padded up from 256 so TT has room to win). We
train it twice with the same data order, step count and cosine learning-rate decay:
dense, and with both hidden Linears as TTLinear trained by CoMERA's two stages (gate
penalty, then a late stage that halves the model). The 512 -> 10 classifier stays dense
in both: a TT there would cap its rank below the 10 classes. We report both test
accuracies, how much smaller the tensorized layers are than the dense weights they replace
(core parameters at the effective ranks vs ``in * out``; biases and the few gate entries
not counted), the rank history, and save the rank and size plots.

    python examples/digits.py --out runs/digits

The run is deterministic for a given seed and thread count (see ``--threads``).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler
from torch import nn
from tqdm.auto import tqdm

from comera_compile.cli.machine import describe_machine, reproducible
from comera_compile.nn import TTLinear
from comera_compile.training import (
    RankAdaptiveTrainer,
    param_groups,
    plot_compression,
    plot_ranks,
    tensorized_compression,
)

SIZES = (64, 512, 512, 10)


def load(seed: int) -> tuple[torch.Tensor, ...]:
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.25, stratify=y, random_state=seed
    )
    scaler = StandardScaler().fit(x_train)
    as_x = lambda a: torch.tensor(scaler.transform(a), dtype=torch.float32)  # noqa: E731
    return as_x(x_train), torch.tensor(y_train), as_x(x_test), torch.tensor(y_test)


def mlp(make_linear, sizes: tuple[int, ...] = SIZES, dropout: float = 0.0) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(make_linear(a, b))
        if i < len(sizes) - 2:
            layers += [nn.ReLU(), nn.Dropout(dropout)]
    return nn.Sequential(*layers)


def tt_mlp(ranks: tuple[int, ...], sizes: tuple[int, ...] = SIZES, dropout: float = 0.0):
    """The MLP with TTLinear hidden layers; the small classifier layer stays dense."""
    rank = iter(ranks)

    def make(a: int, b: int) -> nn.Module:
        return nn.Linear(a, b) if b == sizes[-1] else TTLinear(a, b, ranks=next(rank))

    return mlp(make, sizes, dropout)


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        acc = (model(x).argmax(1) == y).float().mean().item()
    model.train()
    return 100 * acc


def batches(n: int, batch: int, epochs: int, seed: int, name: str = ""):
    g = torch.Generator().manual_seed(seed)
    for _ in tqdm(range(epochs), desc=name, unit="epoch", ncols=99, mininterval=1.0):
        order = torch.randperm(n, generator=g)
        yield from order.split(batch)


def cosine(opt: torch.optim.Optimizer, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    decay = lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total) / total))  # noqa: E731
    return torch.optim.lr_scheduler.LambdaLR(opt, decay)


def train_dense(data, args) -> nn.Module:
    x, y, _, _ = data
    torch.manual_seed(args.seed)
    model = mlp(nn.Linear, dropout=args.dropout)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    schedule = cosine(opt, args.epochs * -(-len(x) // args.batch))
    for idx in batches(len(x), args.batch, args.epochs, args.seed, "dense "):
        loss = F.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        schedule.step()
    return model


def train_comera(data, args) -> tuple[nn.Module, RankAdaptiveTrainer]:
    x, y, _, _ = data
    torch.manual_seed(args.seed)
    model = tt_mlp(tuple(args.ranks), dropout=args.dropout)
    groups = param_groups(model, lr_cores=args.lr_cores, lr_gates=args.lr_gates, lr_rest=1e-3)
    opt = torch.optim.AdamW(groups)
    steps_per_epoch = -(-len(x) // args.batch)
    schedule = cosine(opt, args.epochs * steps_per_epoch)
    trainer = RankAdaptiveTrainer(
        model,
        opt,
        target_ratio=args.target_ratio,
        early_steps=args.early_epochs * steps_per_epoch,
        prune_every=steps_per_epoch,
        task_target=args.task_target,
        total_steps=args.epochs * steps_per_epoch,  # the late stage ends at the target
    )
    for idx in batches(len(x), args.batch, args.epochs, args.seed, "CoMERA"):
        loss = trainer.loss(F.cross_entropy(model(x[idx]), y[idx]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        trainer.step()
        schedule.step()
    trainer.prune()
    return model, trainer


def rank_table(trainer: RankAdaptiveTrainer, every: int) -> str:
    h = trainer.history
    names = h.layer_names()
    lines = [f"{'step':>5} {'stage':>5} {'loss':>6}  " + "  ".join(f"ranks[{n}]" for n in names)]
    for r in h.records[every - 1 :: every]:
        ranks = "  ".join(str(r["ranks"][n][1:-1]) for n in names)
        lines.append(f"{r['step']:>5} {r['stage']:>5} {r['task_loss']:6.3f}  {ranks}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/digits"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--early-epochs", type=int, default=30)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--ranks", type=int, nargs=2, default=[16, 16])
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--target-ratio", type=float, default=0.5)
    p.add_argument("--task-target", type=float, default=0.05)
    p.add_argument("--lr-cores", type=float, default=3e-3)
    p.add_argument("--lr-gates", type=float, default=1e-2)
    p.add_argument("--threads", type=int, default=1, help="fixed so that the numbers repeat")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)  # a bad folder fails before training
    with reproducible(args.seed, args.threads):
        print(describe_machine())
        run(args)


def run(args: argparse.Namespace) -> None:
    data = load(args.seed)

    start = time.perf_counter()
    dense = train_dense(data, args)
    dense_acc = accuracy(dense, data[2], data[3])
    dense_s = time.perf_counter() - start

    start = time.perf_counter()
    model, trainer = train_comera(data, args)
    tt_acc = accuracy(model, data[2], data[3])
    tt_s = time.perf_counter() - start

    tt_layers = [m for m in model if isinstance(m, TTLinear)]
    dense_weights = sum(m.dense_parameters for m in tt_layers)
    cores = sum(m.num_core_parameters() for m in tt_layers)
    steps_per_epoch = -(-len(data[0]) // args.batch)
    print(rank_table(trainer, every=5 * steps_per_epoch))
    print()
    print(f"dense MLP  test accuracy {dense_acc:6.2f}%  ({dense_s:.1f} s)")
    print(f"CoMERA MLP test accuracy {tt_acc:6.2f}%  ({tt_s:.1f} s)")
    print(f"accuracy gap             {dense_acc - tt_acc:+6.2f} points")
    print(
        f"hidden Linear weights (64x512 + 512x512): dense {dense_weights} params, "
        f"TT cores {cores} params\n  -> {tensorized_compression(model):.1f}x smaller "
        "(biases, gates and the dense 512x10 classifier not counted)"
    )
    print(f"final ranks: {[m.ranks for m in tt_layers]}")
    print(
        f"late stage: model size {trainer.size_start} -> {trainer.size()} params "
        f"(target {trainer.size_target:.0f}, reached: {trainer.target_reached})"
    )
    trainer.history.to_csv(args.out / "history.csv")
    print(f"saved {plot_ranks(trainer.history, args.out / 'ranks.png')}")
    print(f"saved {plot_compression(trainer.history, args.out / 'compression.png')}")


if __name__ == "__main__":
    main()
