"""Pretraining race: compressed formats against dense models, on real code, from scratch.

A Hugging Face ``LlamaForCausalLM`` built from a config is pretrained on a byte-level
corpus (by default the Python standard library's own source, which ships with every
Python). Each row trains in its own process, one after the other, with the same data,
steps and schedule, and reports held-out bits per byte:

- ``dense``: the full model (the user's own choice);
- ``dense-equal``: a narrower dense model of the same depth with as many parameters as
  the compressed default (what a user would pick instead of compressing);
- ``default``: ``optimize(budget=...)`` with default options and
  ``param_groups(model, lr=...)`` (the dense model's learning rate, nothing else);
- one row per format (``tt``, ``ttm``, ``lowrank``, ``cola``) at the same budget;
- ``comera``: rank-adaptive training in the default format, as the README's recipe has it:
  ``optimize`` at ``training.start_budget(budget)`` (twice the budget), then
  ``RankAdaptiveTrainer(target_budget=budget)``, which ends at half the start size, the
  size of the ``default`` row within a few percent (same layers at fixed ranks; the table
  shows both sizes);
  ``comera-tt`` does the same with TT layers and is compared with the ``tt`` row;
- ``comera-compiled`` / ``default-compiled``: the same runs with ``optimize``'s default
  ``compile=True`` (eager for the measured compile's wait, or, in a rank-adaptive run of
  known length, for good where a first compile is not expected to pay by the run's end;
  else raced against eager), whose time includes every compile; the graphs compiled are
  counted;
- ``comera-compiled-always``: the rank-adaptive run compiled from its first step,
  ``compile="always"`` with symbolic ranks (``CompileOptions(symbolic_ranks=True)``: the
  blocks' graph serves every cut), whatever a compile is expected to pay back: what the
  compiled path itself costs and saves over the whole run; next to each compiled row, the
  ceiling any compiled run of that length could reach (every step at the eager row's
  profiled bound, ``compile.policy.step_bound``, profiled after its timed run, plus the compiled
  row's first compile);
- ``galore``: the full model with GaLore's optimizer (skipped if ``galore-torch`` is absent).

It prints, and writes to ``benchmarks/results/pretrain.md``, val bits per byte at equal
steps and at equal wall clock (each curve interpolated at the default row's training
time), parameters, training memory and seconds per step; ``--plot`` draws loss against
time. Example::

    python benchmarks/pretrain.py --steps 300 --rows dense,dense-equal,default,tt,cola,comera
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import sysconfig
import tempfile
import time
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_results  # noqa: E402

import comera_compile as cc  # noqa: E402
from comera_compile.compile import graphs_compiled  # noqa: E402
from comera_compile.compile.policy.step_bound import StepProfile, speedup_bound  # noqa: E402
from comera_compile.tables import text_table  # noqa: E402

FORMAT_ROWS = ("tt", "ttm", "lowrank", "cola")
ADAPTIVE_ROWS = {"comera": "default", "comera-tt": "tt"}  # rank-adaptive row: its fixed row
ALL_ROWS = ("dense", "dense-equal", "default", *FORMAT_ROWS, *ADAPTIVE_ROWS, "comera-compiled",
            "comera-compiled-always", "default-compiled", "galore")


def eager_row(row: str) -> str:
    """The row a compiled row is measured against (``comera-compiled-always``: ``comera``)."""
    return row.removesuffix("-always").removesuffix("-compiled")


# ----- data ---------------------------------------------------------------------------------
def corpus_files(root: Path) -> list[Path]:
    """Every text file under ``root`` (a file is its own corpus), sorted for repeatability."""
    if root.is_file():
        return [root]
    suffixes = {".py", ".txt", ".md", ".rst", ".c", ".h", ".js", ".json", ".html", ".toml"}
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in suffixes)


def load_corpus(root: Path, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and held-out bytes: each file goes wholly to one side (by a hash of its name,
    about one in ten held out), so validation is on files never seen in training."""
    files = corpus_files(root)
    train, val = bytearray(), bytearray()
    if len(files) == 1:  # one file: hold out its tail
        data = files[0].read_bytes()
        cut = int(len(data) * 0.9)
        train, val = bytearray(data[:cut]), bytearray(data[cut:])
    for path in files if len(files) > 1 else []:
        side = val if zlib.crc32(path.name.encode()) % 10 == 0 else train
        side += path.read_bytes()
        if len(train) >= limit and len(val) >= limit // 8:
            break
    if len(train) < 10_000 or len(val) < 2_000:
        raise SystemExit(f"corpus {root} is too small: {len(train)} train / {len(val)} val bytes")
    as_tensor = lambda b: torch.frombuffer(bytearray(b[:limit]), dtype=torch.uint8).long()  # noqa: E731
    return as_tensor(train), as_tensor(val)


def corpus_label(path: str) -> str:
    """How results name a corpus: never a path of the machine that ran them."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return "Python stdlib" if Path(path) == stdlib else Path(path).name


def batch(data: torch.Tensor, size: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, data.numel() - seq - 1, (size,), generator=gen)
    return torch.stack([data[s : s + seq + 1] for s in starts.tolist()])


# ----- models -------------------------------------------------------------------------------
def llama(hidden: int, ffn: int, layers: int, heads: int, seq: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=seq,
        tie_word_embeddings=False, attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def narrower(args, params: int):
    """The dense model of the same depth whose parameter count is closest to ``params``:
    hidden and FFN scaled together, head width kept near the full model's."""
    head_dim = args.hidden // args.heads
    best = None
    for hidden in range(16, args.hidden + 1, 8):
        heads = max(1, round(hidden / head_dim))
        while hidden % heads:
            heads -= 1
        ffn = max(8, round(args.ffn * hidden / args.hidden / 8) * 8)
        model = llama(hidden, ffn, args.layers, heads, args.seq)
        gap = abs(count(model) - params)
        if best is None or gap < best[0]:
            best = (gap, model, (hidden, ffn, heads))
    return best[1], best[2]


def build(args, row: str):
    """The row's model and its optimizer parameter groups."""
    torch.manual_seed(args.seed)
    dense = llama(args.hidden, args.ffn, args.layers, args.heads, args.seq)
    if row in ("dense", "galore"):
        return dense, None
    example = (torch.zeros(args.batch, args.seq, dtype=torch.long),)
    if row == "dense-equal":
        target = count(build(args, "default")[0])
        torch.manual_seed(args.seed)
        return narrower(args, target)[0], None
    compiled = "always" if row.endswith("-always") else (
        row.endswith("-compiled") or args.compile)
    row = eager_row(row)
    fixed = ADAPTIVE_ROWS.get(row, row)  # a rank-adaptive row's layers are its fixed row's
    budget = (cc.training.start_budget(args.budget, args.start_factor) if row in ADAPTIVE_ROWS
              else args.budget)
    kwargs = {} if fixed == "default" else {"format": fixed}
    if compiled == "always":  # symbolic ranks: cuts compile nothing
        config = cc.CompressionConfig(budget=budget, compile="always",
                                      compile_options=cc.CompileOptions(symbolic_ranks=True),
                                      **kwargs)
        return cc.optimize(dense, config, example_inputs=example), None
    model = cc.optimize(dense, budget=budget, example_inputs=example, compile=compiled,
                        **kwargs)
    return model, None


def optimizer_for(args, row: str, model):
    if row == "galore":
        from galore_torch import GaLoreAdamW

        big = [p for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n]
        ids = {id(p) for p in big}
        rest = [p for p in model.parameters() if id(p) not in ids]
        groups = [{"params": rest},
                  {"params": big, "rank": args.galore_rank, "update_proj_gap": 50,
                   "scale": 0.25, "proj_type": "std"}]
        return GaLoreAdamW(groups, lr=args.lr, weight_decay=0.0)
    if not cc.nn.tensorized_layers(model):
        groups = model.parameters()
    elif args.uniform_lr:  # the ablation: one rate for every core, as a user would guess
        groups = cc.training.param_groups(model, lr=args.lr, lr_cores=args.lr)
    else:
        groups = cc.training.param_groups(model, lr=args.lr)
    return torch.optim.AdamW(groups, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))


def schedule(step: int, warmup: int, total: int, kind: str = "cosine") -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak (``kind="constant"``: the
    peak rate held to the end)."""
    if step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


def trainer_options(pairs: list[str]) -> dict:
    """``--adapt key=value`` pairs as ``RankAdaptiveTrainer`` keywords (numbers parsed)."""
    options = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        options[key] = json.loads(value) if value[:1] in "-.0123456789[{tfn" else value
    return options


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@torch.no_grad()
def evaluate(model, val_batches: list[torch.Tensor]) -> float:
    model.eval()
    total = 0.0
    for xb in val_batches:
        logits = model(xb[:, :-1]).logits
        total += F.cross_entropy(logits.reshape(-1, 256), xb[:, 1:].reshape(-1)).item()
    model.train()
    return total / len(val_batches) / math.log(2)  # nats per byte -> bits per byte


def run_row(args) -> dict:
    """Train one row in this process and return its measurements."""
    torch.set_num_threads(args.threads)
    wall_start = time.perf_counter()
    train, val = load_corpus(Path(args.corpus), args.corpus_bytes)
    gen = torch.Generator().manual_seed(args.seed + 1)
    val_batches = [batch(val, args.batch, args.seq, gen) for _ in range(args.val_batches)]
    model, _ = build(args, args.row)
    params_start = count(model)
    optimizer = optimizer_for(args, args.row, model)
    base = [g["lr"] for g in optimizer.param_groups]
    trainer = None
    adaptive = eager_row(args.row)
    if adaptive in ADAPTIVE_ROWS:
        # the README's recipe: one number, the budget to end at (optimize started at
        # start_budget of it); another start factor aims at the fixed-rank row's size
        if args.start_factor == cc.training.START_FACTOR:
            target = {"target_budget": args.budget}
        else:
            target = {"target_params": count(build(args, ADAPTIVE_ROWS[adaptive])[0])}
        trainer = cc.training.RankAdaptiveTrainer(  # defaults, but for the run's length
            model, optimizer, total_steps=args.steps, **target, **trainer_options(args.adapt))
    data_gen = torch.Generator().manual_seed(args.seed + 2)
    curve = [(0, 0.0, evaluate(model, val_batches))]
    rss_before = rss_mb()
    peak = rss_before
    elapsed = 0.0
    steps_s = []

    def train_step(step: int) -> float:
        xb = batch(train, args.batch, args.seq, data_gen)
        for group, lr in zip(optimizer.param_groups, base):
            group["lr"] = lr * schedule(min(step, args.steps - 1), args.warmup, args.steps,
                                        args.schedule)
        start = time.perf_counter()
        logits = model(xb[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, 256), xb[:, 1:].reshape(-1))
        if trainer is not None:
            loss = trainer.loss(loss)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if trainer is not None:
            trainer.step()
        return time.perf_counter() - start

    for step in range(args.steps):
        steps_s.append(train_step(step))
        elapsed += steps_s[-1]
        peak = max(peak, rss_mb())
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            curve.append((step + 1, elapsed, evaluate(model, val_batches)))
            if args.verbose:
                print(f"  {args.row} step {step + 1} {elapsed:.1f}s val {curve[-1][2]:.3f}",
                      file=sys.stderr, flush=True)
    peak = max(peak, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    compiled = "compiled" in args.row or args.compile
    cuts = trainer.cuts if trainer is not None else 0
    bound = None
    if not compiled and cc.nn.tensorized_layers(model):
        # after the timed run (its time counts nowhere): one step profiled, one not; the
        # bound of the final (pruned) shapes, whose smaller ranks leave matrix products a
        # smaller share than earlier steps had, so it errs towards compiling's side
        trainer = None  # the run is over: no rank loss, no prune
        profile = StepProfile()
        profiled = train_step(args.steps)
        kept = profile.kept(profiled)
        bound = speedup_bound(min(profiled, train_step(args.steps)), kept)
    return {
        "compiles": graphs_compiled() if compiled else 0,
        "cuts": cuts,
        "wall_s": time.perf_counter() - wall_start,
        "how": cc.summary(model).compiled if cc.nn.tensorized_layers(model) else "",
        "row": args.row,
        "params_start": params_start,
        "params_end": count(model),
        "s_per_step": elapsed / args.steps,
        "first_step_s": steps_s[0],
        "median_step_s": sorted(steps_s)[len(steps_s) // 2],
        "bound": bound,
        "train_mb": peak - rss_before,
        "curve": curve,
    }


# ----- the race -----------------------------------------------------------------------------
def at_time(curve: list, seconds: float) -> tuple[float, bool]:
    """Val bpb interpolated at ``seconds`` of training; flag when the run ended earlier."""
    for (_, t0, v0), (_, t1, v1) in zip(curve, curve[1:]):
        if t0 <= seconds <= t1:
            return v0 + (v1 - v0) * (seconds - t0) / max(t1 - t0, 1e-9), False
    return curve[-1][2], seconds > curve[-1][1]


def comparisons(results: dict, clock: float) -> list[str]:
    """The side-by-side readings the targets name, from rows of this run."""
    end = {row: r["curve"][-1][2] for row, r in results.items()}
    lines = []
    for row in ("default", *FORMAT_ROWS):
        if row in end and "dense-equal" in end:
            gap = end[row] - end["dense-equal"]
            lines.append(f"{row} - dense-equal at equal steps: {gap:+.3f} bpb (negative: "
                         "structure pays at equal parameters)")
        if row in end and "dense" in end:
            gap = at_time(results[row]["curve"], clock)[0] - at_time(results["dense"]["curve"],
                                                                      clock)[0]
            lines.append(f"{row} - dense at {clock:.0f} s: {gap:+.3f} bpb")
    for adaptive, fixed in ADAPTIVE_ROWS.items():
        if adaptive in end and fixed in end:
            lines.append(f"{adaptive} - {fixed} (the same layers at fixed ranks of the same "
                         f"final size): {end[adaptive] - end[fixed]:+.3f} bpb")
    for row in results:
        eager = eager_row(row)
        if eager != row and eager in results:
            ratio = results[eager]["curve"][-1][1] / results[row]["curve"][-1][1]
            whole = results[eager]["wall_s"] / results[row]["wall_s"]
            r = results[row]
            lines.append(f"{row} over {eager}, training time (compiles included): {ratio:.2f}x, "
                         f"whole run (set-up and evaluations too): {whole:.2f}x; "
                         f"{r['compiles']} graphs compiled (training and evaluation), "
                         f"{r['cuts']} shape-changing prunes; {r['how']}")
            ceiling = compiled_ceiling(results[eager], r)
            if ceiling:
                lines.append(ceiling)
    return lines


def compiled_ceiling(eager: dict, compiled: dict) -> str:
    """The most any compiled run of this length could gain end to end: every step at the
    eager row's profiled bound (``compile.policy.step_bound``: the same matrix-product, attention
    and optimizer kernels, the rest free), plus this compiled row's first compile (its first
    step over its median one)."""
    if not eager.get("bound") or not compiled.get("compiles"):
        return ""  # nothing compiled: the row ran eager's steps
    train_s = eager["curve"][-1][1]
    compile_s = max(0.0, compiled["first_step_s"] - compiled["median_step_s"])
    best = train_s / (train_s / eager["bound"] + compile_s)
    return (f"  ceiling for a compiled run of this length: {best:.2f}x end to end (every step "
            f"at the profiled bound, {eager['bound']:.2f}x over eager, plus the first "
            f"compile, {compile_s:.0f} s)")


def race(args) -> None:
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = set(rows) - set(ALL_ROWS)
    if unknown:
        raise SystemExit(f"unknown rows {sorted(unknown)}; choose from {', '.join(ALL_ROWS)}")
    if "galore" in rows:
        try:
            import galore_torch  # noqa: F401
        except ImportError:
            print("galore-torch is not installed (pip install galore-torch): row skipped")
            rows.remove("galore")
    results = {}
    for row in rows:
        cmd = [sys.executable, __file__, "--row", row] + [a for a in sys.argv[1:]]
        t0 = time.time()
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ)
            if not args.warm_cache:  # compiles from scratch, as on a new machine
                env["TORCHINDUCTOR_CACHE_DIR"] = cache
            out = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if out.returncode:
            print(out.stderr[-3000:])
            raise SystemExit(f"row {row} failed")
        results[row] = json.loads(out.stdout.strip().splitlines()[-1])
        r = results[row]
        print(f"{row}: {r['params_start']:,} -> {r['params_end']:,} params, "
              f"{r['s_per_step']:.3f} s/step, val {r['curve'][-1][2]:.3f} bpb "
              f"({time.time() - t0:.0f} s)", flush=True)
    clock_row = "default" if "default" in results else rows[0]
    clock = results[clock_row]["curve"][-1][1]
    header = ["row", "params", "s/step", "train s", "compiles", "train MB",
              f"val bpb @ {args.steps} steps", f"val bpb @ {clock:.0f} s"]
    table = []
    for row, r in results.items():
        value, short = at_time(r["curve"], clock)
        params = f"{r['params_start']:,}"
        if r["params_end"] != r["params_start"]:
            params += f" -> {r['params_end']:,}"
        table.append([row, params, f"{r['s_per_step']:.3f}", f"{r['curve'][-1][1]:.0f}",
                      str(r["compiles"] or "-"), f"{r['train_mb']:.0f}",
                      f"{r['curve'][-1][2]:.3f}", f"{value:.3f}" + (" (ended)" if short else "")])
    text = text_table(header, table, right=range(1, len(header)))
    text += "\n\n" + "\n".join(comparisons(results, clock))
    print(text)
    setup = (f"LlamaForCausalLM {args.layers} x {args.hidden} (FFN {args.ffn}, {args.heads} "
             f"heads), byte vocabulary, sequence {args.seq}, batch {args.batch}, {args.steps} "
             f"AdamW steps ({args.warmup} warm-up, {args.schedule}), lr {args.lr}, budget "
             f"{args.budget} (rank-adaptive rows start at {args.start_factor:g}x it), "
             f"corpus {args.corpus_name or corpus_label(args.corpus)}; equal wall clock = the "
             f"{clock_row} row's training time ({clock:.0f} s); one process per row.")
    body = setup + "\n\n```\n" + text + "\n```\n\ncurves (step, seconds, val bpb):\n\n```\n"
    body += "\n".join(f"{row}: {json.dumps(r['curve'])}" for row, r in results.items())
    body += "\n```\n"
    if not args.no_write:
        print("wrote", write_results(args.results_name, "Pretraining race", body))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for row, r in results.items():
            ax.plot([c[1] for c in r["curve"]], [c[2] for c in r["curve"]], label=row)
        ax.set_xlabel("training seconds")
        ax.set_ylabel("val bits per byte")
        ax.legend()
        fig.savefig(args.plot, dpi=120, bbox_inches="tight")
        print("plot:", args.plot)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="dense,dense-equal,default,tt,lowrank,cola,comera,galore")
    p.add_argument("--corpus", default=sysconfig.get_paths()["stdlib"],
                   help="a text file or a folder of source/text files (default: Python's "
                        "standard library source)")
    p.add_argument("--corpus-name", default=None, help="how the results name the corpus")
    p.add_argument("--corpus-bytes", type=int, default=8_000_000)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--schedule", choices=("cosine", "constant"), default="cosine",
                   help="after the warm-up: cosine decay to a tenth, or the peak rate held")
    p.add_argument("--start-factor", type=float, default=2.0,
                   help="rank-adaptive rows start at this multiple of --budget")
    p.add_argument("--budget", type=float, default=0.25, help="kept share of the parameters")
    p.add_argument("--adapt", action="append", default=[], metavar="KEY=VALUE",
                   help="a RankAdaptiveTrainer keyword for the rank-adaptive rows (repeatable), "
                        "e.g. --adapt settle_fraction=0.3")
    p.add_argument("--uniform-lr", action="store_true",
                   help="ablation: every core at --lr instead of its structure-aware rate")
    p.add_argument("--galore-rank", type=int, default=96)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true", help="compiled compressed rows")
    p.add_argument("--warm-cache", action="store_true",
                   help="compiled rows use inductor's cache as found (default: each row an "
                        "empty one, so every compile is a first compile)")
    p.add_argument("--plot", default=None, help="PNG path for loss against time")
    p.add_argument("--results-name", default="pretrain")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--row", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.row:
        print(json.dumps(run_row(args)))
    else:
        race(args)


if __name__ == "__main__":
    main()
