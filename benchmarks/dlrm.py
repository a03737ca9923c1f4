"""DLRM at 99x: dense sparse tables against TT tables, with and without the hot-row cache.

Each row trains the same DLRM (bottom MLP 13-512-256-16, embedding bags of dimension 16,
dot interaction, top MLP -512-256-1) for the same steps of plain SGD on the same synthetic
click stream (a planted signal: a hidden model of the ids and dense features), in its own
child process, and reports side by side:

- size: parameters of the trained model, hot-row caches included (the ratio is dense over
  this row);
- peak memory: peak RSS during the training steps minus the RSS before the model was
  built (the peak is reset with /proc/self/clear_refs once the model is ready; the
  compressed rows build their DLRM on the meta device, so no dense table ever exists there);
- step time: median wall time of forward + backward + optimizer step over the steps after
  the caches' warm-up (the same steps for every row; batches are made outside the timer),
  then the median over ``--rounds`` processes per row, run in turn (dense, tt, tt+cache,
  dense, ...), so that a slow spell of the machine falls on every row alike;
- held-out log loss and AUC after the last step.

Rows: ``dense`` is what real DLRMs do (``nn.EmbeddingBag(sparse=True)`` and SGD, which
takes sparse gradients and keeps no state); ``tt`` is ``optimize(model, budget=Budget(
ratio=99))`` with ``row_cache=0`` (TT embedding bags, no cache); ``tt+cache`` the same with
``row_cache="auto"`` (a cache where the example ids are skewed enough to pay, none where they
are close to uniform); ``tt+cache@S`` forces a cache of share S of each table (what a cache
costs where it does not pay). The compressed rows train their cores at ``--core-lr`` and
everything else (caches, MLPs, small tables) at the dense row's rate; the MLPs stay dense
(``--exclude``), as in TT-Rec. Two id distributions:
``power`` (rank k drawn with probability ~1/k, as Criteo's ids) and ``uniform``.

    python benchmarks/dlrm.py                       # the four largest Criteo Kaggle tables
    python benchmarks/dlrm.py --tables all --scale 0.01 --steps 100   # 26 tables, a quick look
    python benchmarks/dlrm.py --cards 12000000,4000000,1000000,200000,50000,1000 --dim 64 \
        --bag 3 --ids zipf1.1 --name dlrm_dim64   # another shape: wider rows, bags, Zipf ids

``--ids zipf<a>`` draws rank k with probability ~k^-a.
"""

from __future__ import annotations

import argparse
import dataclasses
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
    SyntheticClicks,
    auc,
    log_loss,
)

import comera_compile as cc  # noqa: E402
from benchmarks._results import write_results  # noqa: E402
from comera_compile.cli.machine import describe_machine  # noqa: E402
from comera_compile.planner import native_lookup  # noqa: E402

HELD_OUT_SEED = 10**9
LARGEST_FOUR = sorted(CRITEO_KAGGLE_CARDINALITIES, reverse=True)[:4]
TWO_SMALL = (1460, 583)  # Criteo Kaggle's first two tables


@dataclasses.dataclass(frozen=True)
class UniformClicks(SyntheticClicks):
    """The same hidden click model, with every id of a table equally likely."""

    def ids(self, table: int, shape: tuple[int, ...], generator: torch.Generator):
        return torch.randint(0, int(self.cardinalities[table]), shape, generator=generator)


@dataclasses.dataclass(frozen=True)
class ZipfClicks(SyntheticClicks):
    """The same hidden click model, rank ``k`` drawn with probability ~``k^-exponent``."""

    exponent: float = 1.1

    def ids(self, table: int, shape: tuple[int, ...], generator: torch.Generator):
        rows, a = int(self.cardinalities[table]), self.exponent
        u = torch.rand(shape, generator=generator, dtype=torch.float64)
        k = ((rows ** (1 - a) - 1) * u + 1) ** (1 / (1 - a))  # the inverse CDF on [1, rows]
        rank = k.floor().long().clamp(1, rows) - 1
        return (rank * 2654435761 + table * 97) % rows


def _data(ids: str, cards: list[int], bag: int = 1) -> SyntheticClicks:
    if ids.startswith("zipf"):
        return ZipfClicks(cards, bag=bag, exponent=float(ids[4:]))
    return (SyntheticClicks if ids == "power" else UniformClicks)(cards, bag=bag)


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS


def _cardinalities(args: argparse.Namespace) -> list[int]:
    if getattr(args, "cards", None):
        return [max(2, round(int(n) * args.scale)) for n in args.cards.split(",")]
    base = LARGEST_FOUR + list(TWO_SMALL) if args.tables == "large4" else (
        CRITEO_KAGGLE_CARDINALITIES)
    return [max(2, round(n * args.scale)) for n in base]


def _row_cache(row: str) -> float | str:
    """``tt``: none; ``tt+cache``: the budget decides; ``tt+cache@0.5``: that share."""
    if row == "tt":
        return 0
    return "auto" if row == "tt+cache" else float(row.split("@")[1])


def run_row(row: str, ids: str, args: argparse.Namespace) -> dict:
    """Train one row in this process and return its measurements."""
    torch.manual_seed(0)
    cards = _cardinalities(args)
    data = _data(ids, cards, args.bag)
    held_dense, held_sparse, held_labels = data.batch(args.held_out, seed=HELD_OUT_SEED)
    with torch.device("meta"):
        dense_params = sum(p.numel() for p in DLRM(cards, dim=args.dim).parameters())
    before = _status_bytes("VmRSS")
    summary = ""
    if row == "dense":
        model = DLRM(cards, dim=args.dim)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    else:
        with torch.device("meta"):  # the dense tables are never allocated
            model = DLRM(cards, dim=args.dim)
        # real ids (the caches measure their distribution), dense features on meta
        dense, sparse, _ = data.batch(args.example, seed=HELD_OUT_SEED + 1)
        config = cc.CompressionConfig(
            budget=cc.Budget(ratio=args.ratio), compile=False, row_cache=_row_cache(row),
            cache_warmup=args.warmup, exclude=args.exclude.split(",") if args.exclude else None)
        model = cc.optimize(model, config, example_inputs=(dense.to("meta"), sparse),
                            inplace=True)
        opt = torch.optim.SGD(cc.training.param_groups(  # gates as cores: no rank schedule
            model, lr=args.lr, lr_cores=args.core_lr, lr_gates=args.core_lr), lr=args.lr)
    _scale_tables(model, args.table_std)
    params = sum(p.numel() for p in model.parameters())
    _reset_peak()
    times, losses = [], []
    for step in range(args.steps):
        dense, sparse, labels = data.batch(args.batch, seed=step)
        start = time.perf_counter()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, sparse), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    peak = _status_bytes("VmHWM") - before
    if row != "dense":
        summary = str(cc.summary(model))
    model.eval()
    with torch.no_grad():
        logits = torch.cat([
            model(held_dense[i : i + 4096], held_sparse[:, i : i + 4096])
            for i in range(0, args.held_out, 4096)
        ])
    tables = [t for t in model.tables if isinstance(t, cc.TTEmbedding)]
    hits = _hit_rate(tables, held_sparse, model)
    return {
        "row": row, "ids": ids, "dense_params": dense_params, "params": params,
        "cache_params": sum(t.cache.weight.numel() for t in tables if t.cache is not None),
        "peak_bytes": peak, "step_s": statistics.median(times[args.warmup + 5:]),
        "log_loss": log_loss(logits, held_labels), "auc": auc(logits, held_labels),
        "train_loss": statistics.mean(losses[-20:]), "hit_rate": hits, "summary": summary,
    }


@torch.no_grad()
def _scale_tables(model, std: float) -> None:
    """Start every table's rows at ``std`` per entry, dense or TT (nn.EmbeddingBag's N(0, 1)
    makes the dot interactions so large that SGD learns nothing of the planted signal)."""
    for table in model.tables:
        if isinstance(table, cc.TTEmbedding):
            table.cores[-1].mul_(std)  # rows are linear in the last core; caches fill later
        else:
            table.weight.mul_(std)


def _hit_rate(tables: list, held_sparse: torch.Tensor, model) -> float | None:
    """Share of held-out lookups of the TT tables that their caches serve."""
    cached = [(i, t) for i, t in enumerate(model.tables) if getattr(t, "cache", None) is not None]
    if not cached:
        return None
    served = sum(float(torch.isin(held_sparse[i], t.cache.ids).sum()) for i, t in cached)
    return served / sum(held_sparse[i].numel() for i, _ in cached)


def _child(row: str, ids: str, argv: list[str]) -> dict:
    cmd = [sys.executable, __file__, "--child", f"{row}:{ids}", *argv]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        return {"row": row, "ids": ids, "error": f"exit status {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _merged(runs: list[dict]) -> dict:
    """One row from its rounds: the median step and peak; the rest (the same seeds) from
    the first round."""
    failed = next((r for r in runs if "error" in r), None)
    if failed:
        return failed
    steps = [r["step_s"] for r in runs]
    return {**runs[0], "step_s": statistics.median(steps), "step_rounds": steps,
            "peak_bytes": statistics.median(r["peak_bytes"] for r in runs)}


def _table(results: list[dict]) -> list[str]:
    """Markdown rows, each compared with the dense row of its id distribution."""
    lines = ["| ids | row | params | smaller | cache params | cache hits | peak MiB | less memory "
             "| step ms | rounds ms | step vs dense | held-out log loss | vs dense | AUC |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['ids']} | {r['row']} | failed: {r['error']} |")
            continue
        dense = next((d for d in results if d["row"] == "dense" and d["ids"] == r["ids"]
                      and "error" not in d), None)
        mem = dense["peak_bytes"] / r["peak_bytes"] if dense else math.nan
        step = r["step_s"] / dense["step_s"] if dense else math.nan
        rel = (r["log_loss"] / dense["log_loss"] - 1) * 100 if dense else math.nan
        hits = "" if r["hit_rate"] is None else f"{r['hit_rate']:.0%}"
        rounds = ", ".join(f"{t * 1e3:.1f}" for t in r.get("step_rounds", [r["step_s"]]))
        lines.append(
            f"| {r['ids']} | {r['row']} | {r['params']:,} | {r['dense_params'] / r['params']:.1f}x "
            f"| {r['cache_params']:,} | {hits} | {r['peak_bytes'] / 2**20:,.0f} | {mem:.1f}x "
            f"| {r['step_s'] * 1e3:.1f} | {rounds} | {step:.2f}x | {r['log_loss']:.4f} "
            f"| {rel:+.2f}% | {r['auc']:.4f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", choices=("large4", "all"), default="large4",
                        help="large4: the four largest Criteo Kaggle tables plus two small "
                        "ones; all: the 26 tables")
    parser.add_argument("--scale", type=float, default=1.0, help="table rows x this factor")
    parser.add_argument("--cards", help="table rows, comma-separated (instead of --tables)")
    parser.add_argument("--dim", type=int, default=16, help="embedding dimension")
    parser.add_argument("--bag", type=int, default=1, help="ids per bag")
    parser.add_argument("--name", default="dlrm", help="results/<name>.md")
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--warmup", type=int, default=40,
                        help="steps whose ids the caches count before their rows are fixed; "
                        "the step time is the median of the steps after warmup + 5")
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--example", type=int, default=4096, help="samples in example_inputs")
    parser.add_argument("--held-out", type=int, default=16384)
    parser.add_argument("--ratio", type=float, default=99)
    parser.add_argument("--lr", type=float, default=0.3, help="SGD rate: dense tables, MLPs, "
                        "caches")
    parser.add_argument("--core-lr", type=float, default=0.05, help="SGD rate of the TT cores")
    parser.add_argument("--table-std", type=float, default=0.1,
                        help="initial scale of every table's entries (dense and TT alike)")
    parser.add_argument("--exclude", default="bottom.*,top.*",
                        help="layers to keep dense (name patterns; default the MLPs, as TT-Rec "
                        "compresses the tables only)")
    parser.add_argument("--ids", default="power,uniform", help="power, uniform, zipf<a>")
    parser.add_argument("--rows", default="dense,tt,tt+cache",
                        help="rows for every id distribution (dense, tt, tt+cache, tt+cache@S)")
    parser.add_argument("--uniform-extra", default="tt+cache@0.5",
                        help="extra rows for uniform ids (what a forced cache costs there)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="processes per row, run in turn; the step is their median")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per row (1: steadier on a shared machine)")
    parser.add_argument("--no-results", action="store_true", help="do not write results/")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args()
    torch.set_num_threads(args.threads)
    if args.child:
        row, ids = args.child.split(":")
        print(json.dumps(run_row(row, ids, args)))
        return
    argv = [a for a in sys.argv[1:]]
    cards = _cardinalities(args)
    size = ("the four largest Criteo Kaggle tables plus two small ones" if args.tables == "large4"
            else "the 26 Criteo Kaggle tables")
    if args.cards:
        size = "tables of " + ", ".join(f"{n:,}" for n in cards) + " rows"
    if args.scale != 1:
        size += f", scaled x{args.scale:g}"
    intro = [
        describe_machine(),
        f"DLRM: {len(cards)} bags of {args.bag} id(s) x dim {args.dim}, {sum(cards):,} rows "
        f"({size}; dense tables {sum(cards) * args.dim * 4 / 2**30:.2f} GiB), batch "
        f"{args.batch}, {args.steps} SGD steps, "
        f"step time over steps {args.warmup + 5}-{args.steps} (the caches fill after "
        f"{args.warmup}), held-out {args.held_out:,}, {args.threads} thread(s), "
        f"{args.rounds} process(es) per row run in turn; SGD at {args.lr:g} (TT cores "
        f"{args.core_lr:g}), tables start at std {args.table_std:g}",
        "TT lookups: " + ("in C (planner.native_lookup), on torch's threads"
                          if native_lookup.available() else
                          "as torch ops (the C lookup could not be built here)"),
    ]
    for ids in args.ids.split(","):
        data = _data(ids, cards, args.bag)
        hd, hs, hl = data.batch(args.held_out, seed=HELD_OUT_SEED)
        best, ctr = data.logit(hd, hs), hl.mean()
        intro.append(
            f"{ids} ids: hidden model's own held-out log loss {log_loss(best, hl):.4f} "
            f"(AUC {auc(best, hl):.4f}); constant CTR "
            f"{log_loss(torch.full_like(hl, math.log(ctr / (1 - ctr))), hl):.4f}")
    print("\n".join(intro), flush=True)
    results = []
    for ids in args.ids.split(","):
        rows = args.rows.split(",")
        if ids == "uniform" and args.uniform_extra:
            rows += args.uniform_extra.split(",")
        runs = {row: [] for row in rows}
        for _ in range(args.rounds):
            for row in rows:
                runs[row].append(_child(row, ids, argv))
                print("\n".join(_table(runs[row][-1:])[2:]), flush=True)
        results += [_merged(runs[row]) for row in rows]
    layers = [f"{r['row']} ({r['ids']} ids):\n{r['summary']}" for r in results
              if r.get("summary") and r["row"] != "tt"]
    table = _table(results)
    print("\n".join(table))
    print("\n\n".join(layers))
    if not args.no_results:
        body = "\n".join(f"- {line}" for line in intro[1:]) + "\n\n" + "\n".join(table)
        body += "\n\n<details><summary>layers of the cached rows</summary>\n\n```\n"
        body += "\n\n".join(layers) + "\n```\n</details>\n"
        write_results(args.name, "DLRM at 99x: dense sparse tables, TT tables, TT tables with "
                      "the hot-row cache", body)


if __name__ == "__main__":
    main()
