"""Held-out accuracy, dense vs CoMERA-compressed, on data that ships with the packages.

scikit-learn's digits, wine and breast cancer (stratified 70/30 splits, standardised) with
an MLP ``in -> 256 -> 256 -> classes``, and the six-encoder classifier on the synthetic
sentence-pair task (fresh held-out examples). Each dense model is trained as is; its
compressed twin is ``optimize(model, budget=...)`` trained with ``RankAdaptiveTrainer``
for the same number of steps, knowing the run's length, so the late stage reaches its
size target by the end: the tensorized layers 12x smaller than the dense weights they
replace (``target_params``; layers left dense count as they are). "TT layers" is their
dense weights over their TT cores at the final ranks; "model" is all parameters.

    PYTHONPATH=. python benchmarks/accuracy.py            # all four rows
    PYTHONPATH=. python benchmarks/accuracy.py --only wine breast_cancer
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import table  # noqa: E402

import comera_compile  # noqa: E402
from comera_compile.cli.machine import describe_machine  # noqa: E402
from comera_compile.cli.pair_task import PairTask  # noqa: E402
from comera_compile.cli.six_encoder import SixEncoderClassifier, SixEncoderConfig  # noqa: E402
from comera_compile.training import (  # noqa: E402
    RankAdaptiveTrainer,
    param_groups,
    tensorized_compression,
    tensorized_layers,
)

COMPRESSION = 12.0  # tensorized layers: dense weights / (TT cores + gates) at the end


# ----- data ----------------------------------------------------------------------------------
def sklearn_split(name: str, seed: int):
    from sklearn import datasets
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    x, y = getattr(datasets, f"load_{name}")(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.3, stratify=y, random_state=seed
    )
    scaler = StandardScaler().fit(x_train)
    as_x = lambda a: torch.tensor(scaler.transform(a), dtype=torch.float32)  # noqa: E731
    train = (as_x(x_train), torch.tensor(y_train))
    return train, (as_x(x_test), torch.tensor(y_test))


def mlp(features: int, classes: int, hidden: int = 256) -> nn.Module:
    return nn.Sequential(
        nn.Linear(features, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, classes),
    )


class PairClassifier(nn.Module):
    """The six-encoder on ``(input_ids, token_type_ids)`` tuples."""

    def __init__(self, config: SixEncoderConfig) -> None:
        super().__init__()
        self.encoder = SixEncoderClassifier(config)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.encoder(batch[0], batch[1])


# ----- training ------------------------------------------------------------------------------
def batches(train, batch: int, steps: int, seed: int):
    """``steps`` minibatches (the whole set each step when ``batch`` covers it)."""
    x, y = train
    if callable(x):  # a generator of fresh examples
        g = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            yield x(batch, g)
        return
    g = torch.Generator().manual_seed(seed)
    order = torch.empty(0, dtype=torch.long)
    for _ in range(steps):
        if len(order) < batch:
            order = torch.cat([order, torch.randperm(len(y), generator=g)])
        idx, order = order[:batch], order[batch:]
        yield x[idx], y[idx]


def fit(model, train, steps, batch, seed, lr, rank_options=None, desc=""):
    groups = param_groups(model, lr_cores=3 * lr, lr_gates=10 * lr, lr_rest=lr)
    opt = torch.optim.AdamW(groups if rank_options else model.parameters(), lr=lr)
    trainer = None
    if rank_options:
        target = target_params(model, COMPRESSION)
        trainer = RankAdaptiveTrainer(
            model, opt, total_steps=steps, target_params=target, **rank_options
        )
    model.train()
    for x, y in tqdm(batches(train, batch, steps, seed), total=steps, desc=desc, leave=False):
        loss = F.cross_entropy(model(x), y)
        if trainer is not None:
            loss = trainer.loss(loss)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if trainer is not None:
            trainer.step()
    if trainer is not None:
        trainer.prune()
    model.eval()
    return trainer


def target_params(model: nn.Module, compression: float) -> int:
    """The model size at which its tensorized layers are ``compression`` times smaller than
    the dense weights they replace (the rest of the model counted as it is)."""
    layers = tensorized_layers(model).values()
    inside = {id(p) for layer in layers for p in (*layer.cores, *layer.gates)}
    rest = sum(p.numel() for p in model.parameters() if id(p) not in inside)
    return rest + int(sum(layer.dense_parameters for layer in layers) / compression)


@torch.no_grad()
def accuracy(model, test) -> float:
    x, y = test
    return 100 * (model(x).argmax(1) == y).float().mean().item()


def params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def compare(name, dense, train, test, steps, batch, lr, budget, rank_options, seed=0):
    torch.manual_seed(seed)
    start = time.perf_counter()
    compressed = comera_compile.optimize(copy.deepcopy(dense), budget=budget, compile=False)
    fit(dense, train, steps, batch, seed, lr, desc=f"{name} dense")
    dense_s = time.perf_counter() - start
    start = time.perf_counter()
    trainer = fit(compressed, train, steps, batch, seed, lr, rank_options, desc=f"{name} TT")
    tt_s = time.perf_counter() - start
    dense_acc, tt_acc = accuracy(dense, test), accuracy(compressed, test)
    return [
        name,
        f"{dense_acc:.1f}",
        f"{tt_acc:.1f}",
        f"{tt_acc - dense_acc:+.1f}",
        f"{tensorized_compression(compressed):.1f}x",
        f"{params(dense):,} -> {params(compressed):,} ({params(dense) / params(compressed):.1f}x)",
        f"{trainer.target_reached}",
        f"{steps}",
        f"{dense_s:.0f} / {tt_s:.0f}",
    ]


def pair_task_row(steps: int, seed: int) -> list[str]:
    """A small six-encoder (2 layers, hidden 192) on fresh pair-task batches."""
    task = PairTask(vocab_size=2048)
    config = SixEncoderConfig(
        vocab_size=2048, hidden=192, layers=2, heads=4, ffn=768, dropout=0.0, max_position=64
    )
    ids, types, labels = task.batch(2000, torch.Generator().manual_seed(99))
    test = ((ids, types), labels)

    def fresh(size, g):
        ids, types, labels = task.batch(size, g)
        return (ids, types), labels

    torch.manual_seed(seed)
    dense = PairClassifier(config)
    options = {"early_steps": steps // 2, "prune_every": 100}
    return compare("pair_task", dense, (fresh, None), test, steps, 32, 3e-4, 0.1, options, seed)


SKLEARN = {  # name: (steps, batch, lr)
    "digits": (1500, 64, 1e-3),
    "wine": (800, 1024, 1e-3),
    "breast_cancer": (800, 1024, 1e-3),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--only", nargs="*", default=None, help="rows to run (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pair-steps", type=int, default=1000)
    args = p.parse_args()
    print(describe_machine())
    torch.set_num_threads(1)  # small matmuls: more threads only contend
    names = args.only or [*SKLEARN, "pair_task"]
    rows = []
    for name in names:
        if name in SKLEARN:
            steps, batch, lr = SKLEARN[name]
            train, test = sklearn_split(name, args.seed)
            classes = int(train[1].max()) + 1
            torch.manual_seed(args.seed)
            dense = mlp(train[0].shape[1], classes)
            options = {"early_steps": steps // 2, "prune_every": 50}
            row = compare(name, dense, train, test, steps, batch, lr, 0.2, options, args.seed)
        elif name == "pair_task":
            row = pair_task_row(args.pair_steps, args.seed)
        else:
            raise SystemExit(f"unknown row {name!r}; choose from {[*SKLEARN, 'pair_task']}")
        rows.append(row)
        print(" | ".join(row), flush=True)
    header = [
        "data", "dense %", "TT %", "gap", "TT layers", "model params", "target", "steps", "s",
    ]
    print(table(rows, header))


if __name__ == "__main__":
    main()
