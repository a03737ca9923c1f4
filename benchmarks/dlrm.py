"""DLRM on Criteo-Kaggle-sized tables: dense embedding bags against comera_compile.optimize.

Each row trains the same DLRM (bottom MLP 13-512-256-16, 26 embedding bags of dimension
16, dot interaction, top MLP 367-512-256-1) for the same steps on the same synthetic
click stream, in its own child process, and reports side by side:

- size: parameters of the trained model (the ratio is dense over this row);
- peak memory: peak RSS during the training steps minus the RSS before the model was
  built (the peak is reset with /proc/self/clear_refs once the model is ready; the
  compressed row builds its DLRM on the meta device, so no dense table ever exists there);
- step time: median wall time of forward + backward + optimizer step (batches are made
  outside the timer), and held-out log loss / AUC after the last step.

Rows: ``dense`` is what real DLRMs do (``nn.EmbeddingBag(sparse=True)``, plain SGD, which
takes sparse gradients and keeps no state); ``comera`` is ``optimize`` under a budget
(TT embedding bags for the large tables, what the budget leaves dense stays dense) trained
with Adagrad (fused over the dense gradients); ``torchrec`` is TorchRec's
EmbeddingBagCollection when it is installed.

    python benchmarks/dlrm.py                 # full Criteo Kaggle tables (2.2 GB dense), batch 2048
    python benchmarks/dlrm.py --scale 0.01 --steps 100   # a quick look
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # dlrm_model

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

ROWS = ("dense", "comera", "torchrec")
HELD_OUT_SEED = 10**9


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS


def _cardinalities(scale: float) -> list[int]:
    return [max(2, round(n * scale)) for n in CRITEO_KAGGLE_CARDINALITIES]


def _torchrec_missing() -> str | None:
    """Why TorchRec cannot run here (None if it imports with its fbgemm kernels)."""
    try:
        import fbgemm_gpu  # noqa: F401
        import torchrec  # noqa: F401
    except Exception as exc:  # ImportError, or OSError from fbgemm's compiled kernels
        lines = [line for line in str(exc).splitlines() if line.strip()]
        return f"{type(exc).__name__}: {(lines[-1] if lines else '')[:300]}"
    return None


def run_row(row: str, args: argparse.Namespace) -> dict:
    """Train one row in this process and return its measurements."""
    from tqdm import tqdm

    torch.manual_seed(0)
    cards = _cardinalities(args.scale)
    data = SyntheticClicks(cards, bag=args.bag)
    held_dense, held_sparse, held_labels = data.batch(args.held_out, seed=HELD_OUT_SEED)
    with torch.device("meta"):
        dense_params = sum(p.numel() for p in DLRM(cards).parameters())
    before = _status_bytes("VmRSS")
    if row == "dense":
        model = DLRM(cards)
        opt = torch.optim.SGD(model.parameters(), lr=args.dense_lr)
    elif row == "comera":
        with torch.device("meta"):  # the dense tables are never allocated
            model = DLRM(cards)
        example = tuple(x.to("meta") for x in data.batch(64, seed=HELD_OUT_SEED + 1)[:2])
        include = args.include.split(",") if args.include else None
        exclude = args.exclude.split(",") if args.exclude else None
        model = cc.optimize(model, cc.CompressionConfig(budget=args.budget, max_rank=args.max_rank,
                                                        include=include, exclude=exclude),
                            example_inputs=example, compile=False, inplace=True)
        opt = Adagrad(model, lr=args.comera_lr)
    else:
        raise ValueError(f"unknown row {row!r}")
    params = sum(p.numel() for p in model.parameters())
    _reset_peak()
    times = []
    for step in tqdm(range(args.steps), desc=row, file=sys.stderr, mininterval=5):
        dense, sparse, labels = data.batch(args.batch, seed=step)
        start = time.perf_counter()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, sparse), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
    peak = _status_bytes("VmHWM") - before
    with torch.no_grad():
        logits = torch.cat([
            model(held_dense[i : i + 4096], held_sparse[:, i : i + 4096])
            for i in range(0, args.held_out, 4096)
        ])
    return {
        "row": row,
        "dense_params": dense_params,
        "params": params,
        "peak_bytes": peak,
        "step_s": statistics.median(times[min(5, len(times) - 1):]),
        "log_loss": log_loss(logits, held_labels),
        "auc": auc(logits, held_labels),
        "summary": str(cc.summary(model)) if row == "comera" else "",
    }


def _child(row: str, argv: list[str]) -> dict:
    cmd = [sys.executable, __file__, "--child", row, *argv]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        return {"row": row, "error": f"exit status {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="table rows x this factor")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=2048,
                        help="samples per step (at 512 the TT lookups' fixed cost per call shows)")
    parser.add_argument("--bag", type=int, default=1, help="ids per bag (1: one-hot)")
    parser.add_argument("--held-out", type=int, default=16384)
    parser.add_argument("--budget", default="100x")
    parser.add_argument("--dense-lr", type=float, default=1.0)  # best of 0.2, 1.0
    parser.add_argument("--comera-lr", type=float, default=0.03)  # .1 diverges at batch 2048
    parser.add_argument("--max-rank", type=int, default=None, help="cap on the TT ranks")
    parser.add_argument("--include", default="", help="layers to tensorize (name patterns, "
                        "comma-separated; default: what the budget picks)")
    parser.add_argument("--exclude", default="", help="layers to keep dense (name patterns)")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per row (1: steadier on a shared machine)")
    parser.add_argument("--child", choices=ROWS, help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args()
    torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(run_row(args.child, args)))
        return
    argv = sys.argv[1:]
    print(describe_machine())
    cards = _cardinalities(args.scale)
    rows_total = sum(cards)
    size = "full Criteo Kaggle tables" if args.scale == 1 else f"tables scaled x{args.scale:g}"
    print(
        f"DLRM: 26 bags x dim 16, {rows_total:,} rows ({size}; dense tables "
        f"{rows_total * 16 * 4 / 2**30:.2f} GiB), batch {args.batch}, {args.steps} steps, "
        f"{args.bag} id(s) per bag, held-out {args.held_out:,}"
    )
    data = SyntheticClicks(cards, bag=args.bag)
    hd, hs, hl = data.batch(args.held_out, seed=HELD_OUT_SEED)
    best = data.logit(hd, hs)
    print(
        f"held-out: {hl.mean():.3f} clicks; hidden model itself: log loss "
        f"{log_loss(best, hl):.4f}, AUC {auc(best, hl):.4f}; constant CTR: log loss "
        f"{log_loss(torch.full_like(hl, math.log(hl.mean() / (1 - hl.mean()))), hl):.4f}"
    )
    print("peak MiB: peak RSS during the steps minus RSS before building the model (the peak is "
          "reset once the model is ready); step: median ms, batches made outside the timer")
    results = []
    for row in args.rows.split(","):
        if row == "torchrec":
            why = _torchrec_missing()
            if why is not None:
                print(f"torchrec: skipped, it does not import here ({why})")
                continue
            print("torchrec: imports, but its row is not written yet (no working install to "
                  "develop it against)")
            continue
        results.append(_child(row, argv))
    for r in results:
        if r.get("summary"):
            print(f"{r['row']} layers (optimize(model, {args.budget!r})):\n{r['summary']}")
    dense = next((r for r in results if r["row"] == "dense" and "error" not in r), None)
    header = (f"{'row':<8} {'params':>12} {'smaller':>8} {'peak MiB':>9} {'less mem':>9} "
              f"{'step ms':>8} {'log loss':>9} {'vs dense':>9} {'AUC':>7}")
    print(header)
    for r in results:
        if "error" in r:
            print(f"{r['row']:<8} failed: {r['error']}")
            continue
        ratio = r["dense_params"] / r["params"]
        mem = dense["peak_bytes"] / r["peak_bytes"] if dense else float("nan")
        rel = (r["log_loss"] / dense["log_loss"] - 1) * 100 if dense else float("nan")
        print(
            f"{r['row']:<8} {r['params']:>12,} {ratio:>7.1f}x {r['peak_bytes'] / 2**20:>9.0f} "
            f"{mem:>8.1f}x {r['step_s'] * 1e3:>8.1f} {r['log_loss']:>9.4f} {rel:>+8.2f}% "
            f"{r['auc']:>7.4f}"
        )


if __name__ == "__main__":
    main()
