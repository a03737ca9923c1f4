"""Compress a DLRM recommender 100x and train it: sparse tables become TT embedding bags.

The DLRM declares its 26 tables ``nn.EmbeddingBag(..., sparse=True)`` as real ones do;
``optimize`` turns the large ones into TT embedding bags (their cores get small dense
gradients, so one ordinary Adagrad trains everything) and keeps what the budget allows
dense. The model is built on the meta device, so no dense table is ever allocated. By
default the tables are the Criteo Kaggle sizes scaled by 1/100 so this runs in about a
minute; ``--scale 1`` trains the full 33.8M-row model (2 GiB if it were dense).

    python examples/dlrm.py [--scale 0.01] [--steps 200]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dlrm_model import (  # noqa: E402
    CRITEO_KAGGLE_CARDINALITIES,
    DLRM,
    Adagrad,
    SyntheticClicks,
    auc,
    log_loss,
)

import comera_compile as cc  # noqa: E402
from comera_compile.cli.machine import describe_machine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=0.01, help="table rows x this factor")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--budget", default="100x")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: steadier on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(describe_machine())
    torch.manual_seed(0)
    cards = [max(2, round(n * args.scale)) for n in CRITEO_KAGGLE_CARDINALITIES]
    print(f"tables: Criteo Kaggle sizes x{args.scale:g} = {sum(cards):,} rows")
    data = SyntheticClicks(cards)

    with torch.device("meta"):  # nn.EmbeddingBag(..., sparse=True) tables, as in real DLRMs
        model = DLRM(cards)
    example = tuple(x.to("meta") for x in data.batch(64, seed=10**9 + 1)[:2])
    model = cc.optimize(model, args.budget, example_inputs=example, compile=False, inplace=True)
    print(cc.summary(model))

    opt = Adagrad(model, lr=0.03)  # fused over dense gradients, sparse kernel over the rest
    for step in tqdm(range(args.steps), desc="training"):
        dense, sparse, labels = data.batch(512, seed=step)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, sparse), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()

    dense, sparse, labels = data.batch(8192, seed=10**9)
    with torch.no_grad():
        logits = model(dense, sparse)
    print(f"held-out log loss {log_loss(logits, labels):.4f}, AUC {auc(logits, labels):.4f} "
          f"(hidden model: {log_loss(data.logit(dense, sparse), labels):.4f})")


if __name__ == "__main__":
    main()
