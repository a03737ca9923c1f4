"""The pretraining race as a compute frontier: compressed formats against dense models of
every width, by wall clock and by training memory.

A Hugging Face ``LlamaForCausalLM`` built from a config is pretrained from scratch on a
byte-level corpus (by default the Python standard library's own source, which ships with
every Python), with the pieces of ``benchmarks/pretrain.py`` (corpus, model, held-out bits
per byte, one process per row). Rows:

- ``dense@W``: the dense model at width ``W`` of the full one (hidden and FFN scaled, depth
  kept, heads of about the full model's head width);
- ``default@W``: ``optimize`` with every default but ``compile`` (eager unless ``--compile``),
  at a parameter budget equal to ``dense@W``'s parameter count, trained with
  ``param_groups(model, lr=...)``;
- ``FORMAT@W``: the same with ``format=FORMAT`` (``cola``, ``lowrank``, ``btt``,
  ``monarch``; a format this package lacks is skipped with a printed line, and one that is
  the default's own is not run twice).

Every row trains the same steps on the same batches with AdamW and the same schedule. The
script reports, side by side from one run:

- the wall-clock frontier: at each row's end time, the best dense row and the best
  compressed row (held-out bpb; a row that ended earlier counts with its final value);
- the memory frontier: at each row's training memory, the best dense and compressed rows
  that fit in it (final bpb). Training memory is the peak RSS from just before the model is
  built to the end of training (the kernel's high-water mark, reset then) minus the RSS at
  that moment: the model, its optimizer state and the steps' activations;
- equal parameters at equal steps: each compressed row against the dense row of its
  parameter count, at the final step and at step 300;
- a verdict: does any compressed row end below the dense frontier at its own end time?

It writes ``benchmarks/results/NAME.md`` (tables, no curves), the raw curves to
``benchmarks/results/NAME.json`` and two plots to ``docs/img/`` (bpb against seconds, bpb
against MB).

``--gpu`` runs the GPU form instead: LLaMA at the 60M shape (hidden 512, FFN 1376, 8 layers,
8 heads, vocabulary 32000, sequence 256; the byte corpus's tokens fill the first 256 ids),
bf16 autocast, rows dense and the default, eager and compiled (the default with the
``comera`` backend, which runs CUDA Graph trees on CUDA; dense with ``torch.compile``): step
time, peak memory (``torch.cuda.max_memory_allocated``), tokens per second and a short
quality race, written to ``benchmarks/results/frontier_cuda.md``. Examples::

    python benchmarks/frontier.py --lock /tmp/comera-bench.lock
    python benchmarks/frontier.py --steps 300 --match 0.5 --formats default,lowrank
    python benchmarks/frontier.py --gpu
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import math
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import RESULTS_DIR, write_results  # noqa: E402
from pretrain import (  # noqa: E402
    batch,
    corpus_label,
    count,
    llama,
    load_corpus,
    optimizer_for,
    rss_mb,
)
from pretrain import schedule as cosine_schedule  # noqa: E402

import comera_compile as cc  # noqa: E402
from comera_compile.tables import text_table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FORMATS = ("default", "cola", "lowrank", "btt", "monarch")
CPU_SHAPE = {"layers": 4, "hidden": 384, "ffn": 1024, "heads": 6, "seq": 128, "batch": 16,
             "vocab": 256, "steps": 900}
GPU_SHAPE = {"layers": 8, "hidden": 512, "ffn": 1376, "heads": 8, "seq": 256, "batch": 16,
             "vocab": 32000, "steps": 400}
GPU_ROWS = ("dense", "dense-compiled", "default", "default-compiled")
STDLIB = sysconfig.get_paths()["stdlib"]


# ----- rows ---------------------------------------------------------------------------------
def parse_row(row: str) -> tuple[str, float]:
    """``"cola@0.5"`` -> ``("cola", 0.5)``; a bare GPU row has width 1."""
    kind, _, width = row.partition("@")
    return kind, float(width) if width else 1.0


def available_formats() -> set[str]:
    """The Linear formats this package's ``optimize`` accepts."""
    from comera_compile.passes.specs import LINEAR_FORMATS

    return set(LINEAR_FORMATS)


def plan_rows(args, notes: list[str] | None = None) -> list[str]:
    """The rows to run: every dense width, then each format at each matched width (the
    default first, so a named format that is the default's own can be skipped); what is
    left out is printed and added to ``notes``."""
    notes = [] if notes is None else notes
    if args.rows:
        return [r.strip() for r in args.rows.split(",") if r.strip()]
    floats = lambda s: [float(w) for w in s.split(",") if w.strip()]  # noqa: E731
    rows = [f"dense@{w:g}" for w in floats(args.widths)]
    have = available_formats()
    for fmt in [f.strip() for f in args.formats.split(",") if f.strip()]:
        if fmt != "default" and fmt not in have:
            notes.append(f"format {fmt!r} is not in this package "
                         f"({', '.join(sorted(have))}): its rows are skipped")
            print(notes[-1])
            continue
        rows += [f"{fmt}@{w:g}" for w in floats(args.match)]
    return rows


def dense_shape(args, width: float) -> tuple[int, int, int]:
    """Hidden, FFN and heads of the dense model at ``width`` of the full one: hidden and FFN
    scaled (multiples of 8), heads as many as keep the full model's head width, an even one
    (rotary embeddings rotate pairs)."""
    hidden = max(16, round(args.hidden * width / 8) * 8)
    ffn = max(16, round(args.ffn * width / 8) * 8)
    head_dim = args.hidden // args.heads
    heads = max(1, round(hidden / head_dim))
    while hidden % heads or (hidden // heads) % 2:
        heads -= 1
    return hidden, ffn, heads


def dense_model(args, width: float) -> torch.nn.Module:
    hidden, ffn, heads = dense_shape(args, width)
    model = llama(hidden, ffn, args.layers, heads, args.seq)
    if args.vocab != 256:  # the GPU shape's vocabulary; the byte tokens fill its first ids
        model.resize_token_embeddings(args.vocab, mean_resizing=False)
    return model


def build(args, row: str, device: str = "cpu") -> torch.nn.Module:
    """The row's model: dense at its width, or compressed at the parameter count of the dense
    model of its width (``--gpu``: at ``--budget``)."""
    kind, width = parse_row(row)
    compiled = kind.endswith("-compiled")
    kind = kind.removesuffix("-compiled")
    torch.manual_seed(args.seed)
    if kind == "dense":
        model = dense_model(args, width).to(device)
        return torch.compile(model) if compiled else model
    full = dense_model(args, 1.0).to(device)
    budget = args.budget if args.gpu else count(dense_model(args, width))
    example = (torch.zeros(args.batch, args.seq, dtype=torch.long, device=device),)
    fmt = None if kind == "default" else kind
    compile_mode = "always" if compiled else args.compile
    return cc.optimize(full, budget=budget, format=fmt, example_inputs=example,
                       compile=compile_mode)


def formats_of(model: torch.nn.Module) -> list[str]:
    """The Linear formats a compressed model holds (empty for a dense one)."""
    if not cc.nn.tensorized_layers(model):
        return []
    return sorted({r["format"] for r in cc.summary(model).records if r["format"] != "tt_embedding"})


# ----- one row, in its own process ----------------------------------------------------------
def lr_factor(args, step: int) -> float:
    """Linear warm-up, then constant (``--schedule constant``) or cosine to a tenth."""
    if args.schedule == "cosine":
        return cosine_schedule(step, args.warmup, args.steps)
    return min(1.0, (step + 1) / args.warmup) if args.warmup else 1.0


def high_water_reset() -> bool:
    """Reset the kernel's peak-RSS mark (``VmHWM``) to the current RSS; False if refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def high_water_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


@torch.no_grad()
def val_bpb(model, val_batches: list[torch.Tensor], autocast) -> float:
    """Held-out bits per byte (one token is one byte)."""
    model.eval()
    total = 0.0
    for xb in val_batches:
        with autocast():
            logits = model(xb[:, :-1]).logits
        total += F.cross_entropy(logits.float().reshape(-1, logits.size(-1)),
                                 xb[:, 1:].reshape(-1)).item()
    model.train()
    return total / len(val_batches) / math.log(2)


def run_row(args) -> dict:
    """Train one row in this process and return its measurements."""
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    train, val = load_corpus(Path(args.corpus), args.corpus_bytes)
    gen = torch.Generator().manual_seed(args.seed + 1)
    val_batches = [batch(val, args.batch, args.seq, gen).to(device)
                   for _ in range(args.val_batches)]
    if args.bf16:
        autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16)  # noqa: E731
    else:
        autocast = contextlib.nullcontext
    rss_before = rss_mb()
    reset = high_water_reset()
    model = build(args, args.row, device=str(device))
    kind = parse_row(args.row)[0].removesuffix("-compiled")
    optimizer = optimizer_for(args, kind, model)
    base = [g["lr"] for g in optimizer.param_groups]
    data_gen = torch.Generator().manual_seed(args.seed + 2)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    peak = rss_mb()
    curve = [(0, 0.0, val_bpb(model, val_batches, autocast))]
    elapsed, steps_s = 0.0, []
    for step in range(args.steps):
        xb = batch(train, args.batch, args.seq, data_gen).to(device)
        for group, lr in zip(optimizer.param_groups, base):
            group["lr"] = lr * lr_factor(args, step)
        start = time.perf_counter()
        if cuda and "compiled" in args.row:
            torch.compiler.cudagraph_mark_step_begin()
        with autocast():
            logits = model(xb[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)),
                               xb[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()  # time the finished step, not its launch
        steps_s.append(time.perf_counter() - start)
        elapsed += steps_s[-1]
        peak = max(peak, rss_mb())
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            curve.append((step + 1, elapsed, val_bpb(model, val_batches, autocast)))
            if args.verbose:
                print(f"  {args.row} step {step + 1} {elapsed:.1f}s val {curve[-1][2]:.3f}",
                      file=sys.stderr, flush=True)
    if reset:
        peak = max(peak, high_water_mb())
    median = sorted(steps_s)[len(steps_s) // 2]
    return {
        "row": args.row,
        "formats": formats_of(model),
        "params": count(model),
        "s_per_step": elapsed / args.steps,
        "first_step_s": steps_s[0],
        "median_step_s": median,
        "tokens_per_s": args.batch * args.seq / median,
        "train_mb": peak - rss_before,
        "cuda_peak_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
        "memory_how": "high-water mark" if reset else "sampled after each step",
        "curve": curve,
    }


# ----- the frontier arithmetic --------------------------------------------------------------
def value_at(curve: list, seconds: float) -> float:
    """Held-out bpb of a row after ``seconds`` of training: interpolated between its
    evaluations; a row that ended earlier keeps its final value (its model is done)."""
    if seconds >= curve[-1][1]:
        return curve[-1][2]
    for (_, t0, v0), (_, t1, v1) in zip(curve, curve[1:]):
        if t0 <= seconds <= t1:
            return v0 + (v1 - v0) * (seconds - t0) / max(t1 - t0, 1e-12)
    return curve[0][2]


def value_at_step(curve: list, step: int) -> float:
    """Held-out bpb at ``step`` (interpolated between evaluations; the last past the end)."""
    for (s0, _, v0), (s1, _, v1) in zip(curve, curve[1:]):
        if s0 <= step <= s1:
            return v0 + (v1 - v0) * (step - s0) / max(s1 - s0, 1)
    return curve[-1][2]


def is_dense(row: str) -> bool:
    return parse_row(row)[0].removesuffix("-compiled") == "dense"


def best_at(curves: dict[str, list], seconds: float) -> tuple[str, float]:
    """The row with the lowest bpb after ``seconds`` of training, and that bpb."""
    return min(((row, value_at(c, seconds)) for row, c in curves.items()), key=lambda x: x[1])


def time_frontier(results: dict, times: list[float]) -> list[tuple]:
    """Per time: (seconds, best dense row, its bpb, best compressed row, its bpb)."""
    dense = {r: v["curve"] for r, v in results.items() if is_dense(r)}
    comp = {r: v["curve"] for r, v in results.items() if not is_dense(r)}
    out = []
    for t in times:
        d = best_at(dense, t) if dense else ("-", math.nan)
        c = best_at(comp, t) if comp else ("-", math.nan)
        out.append((t, *d, *c))
    return out


def memory_frontier(results: dict) -> list[tuple]:
    """Per row's training memory (ascending): (MB, best dense row within it, its final bpb,
    best compressed row within it, its final bpb); "-" where none fits."""
    out = []
    for mb in sorted({r["train_mb"] for r in results.values()}):
        best = {}
        for dense in (True, False):
            fits = [(row, r["curve"][-1][2]) for row, r in results.items()
                    if is_dense(row) == dense and r["train_mb"] <= mb]
            best[dense] = min(fits, key=lambda x: x[1]) if fits else ("-", math.nan)
        out.append((mb, *best[True], *best[False]))
    return out


def verdicts(results: dict) -> tuple[list[tuple], bool]:
    """Per compressed row: (row, end seconds, final bpb, best dense row then, its bpb, gap);
    and whether any compressed row ends below the dense frontier at its own end time."""
    dense = {r: v["curve"] for r, v in results.items() if is_dense(r)}
    rows = []
    for row, r in results.items():
        if is_dense(row) or not dense:
            continue
        end, final = r["curve"][-1][1], r["curve"][-1][2]
        d_row, d_bpb = best_at(dense, end)
        rows.append((row, end, final, d_row, d_bpb, final - d_bpb))
    rows.sort(key=lambda x: x[5])
    return rows, any(gap < 0 for *_, gap in rows)


# ----- the race -----------------------------------------------------------------------------
def setup_key(args) -> dict:
    """What makes two runs' rows comparable (``--resume`` reuses rows only when equal)."""
    keys = ("layers", "hidden", "ffn", "heads", "seq", "batch", "vocab", "steps", "warmup",
            "lr", "schedule", "corpus_name", "corpus_bytes", "eval_every", "val_batches",
            "threads", "seed", "compile", "bf16", "device", "budget")
    return {k: getattr(args, k) for k in keys}


@contextlib.contextmanager
def lock(path: str | None):
    """Hold ``path``'s flock for one row (other benchmarks may time between rows)."""
    if not path:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run_rows(args, rows: list[str], json_path: Path, notes: list[str]) -> dict:
    """Run each row in a process of its own; keep (``--resume``) rows a same-setup run of
    this script already left in ``json_path``. A row that fails is left out, its error's
    last line added to ``notes``."""
    results, dates, failed = {}, {}, set()
    if args.resume and json_path.exists():
        old = json.loads(json_path.read_text())
        if old.get("setup") == setup_key(args):
            for r, v in old["rows"].items():
                if r in rows and "failed" in v:  # a row that could not run: say why
                    failed.add(r)
                    notes.append(f"{r}: failed, left out: {v['failed']}")
                elif r in rows:
                    results[r] = v
            dates = {r: d for r, d in old.get("dates", {}).items() if r in results}
            print(f"reusing {len(results)} rows of {json_path.name}: {', '.join(results)}")
        else:
            print(f"{json_path.name} has another setup: every row runs again")
    for row in rows:
        if row in results or row in failed:
            continue
        kind, width = parse_row(row)
        default = results.get(f"default@{width:g}")
        if default and default["formats"] == [kind]:
            notes.append(f"{row}: not run, the default at this budget is already {kind}")
            print(notes[-1])
            continue
        if args.report_only:
            notes.append(f"{row}: not run")
            continue
        cmd = [sys.executable, __file__, *args.argv, "--row", row]
        t0 = time.time()
        with lock(args.lock):
            out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            print(out.stderr[-3000:])
            last = (out.stderr.strip().splitlines() or ["no message"])[-1]
            notes.append(f"{row}: failed, left out: {last[:300]}")
            print(notes[-1])
            if not args.no_write:  # kept, so that a later report says why the row is missing
                save_rows(args, json_path, {row: {"failed": last[:300]}},
                          {row: time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())})
            continue
        results[row] = json.loads(out.stdout.strip().splitlines()[-1])
        dates[row] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        r = results[row]
        print(f"{label(row, r)}: {r['params']:,} params, {r['s_per_step']:.3f} s/step, "
              f"{r['train_mb']:.0f} MB, val {r['curve'][-1][2]:.3f} bpb "
              f"({time.time() - t0:.0f} s)", flush=True)
        if not args.no_write:  # after every row, so a stopped run keeps what it measured
            save_rows(args, json_path, {row: results[row]}, {row: dates[row]})
    return results


def save_rows(args, json_path: Path, rows: dict, dates: dict) -> None:
    """Add ``rows`` to the raw curves file, keeping the rows of the same setup already there
    (another run of this script may be adding its own)."""
    saved = {"setup": setup_key(args), "dates": {}, "rows": {}}
    if json_path.exists():
        old = json.loads(json_path.read_text())
        if old.get("setup") == saved["setup"]:
            saved = old
    saved["rows"].update(rows)
    saved["dates"].update(dates)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = json_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(saved, indent=1))
    tmp.replace(json_path)


def label(row: str, r: dict) -> str:
    kind, _ = parse_row(row)
    return f"{row} ({r['formats'][0]})" if kind == "default" and len(r["formats"]) == 1 else row


def fmt(v: float) -> str:
    return "-" if math.isnan(v) else f"{v:.3f}"


def report(args, results: dict) -> tuple[str, bool]:
    """The tables and the verdict, as printed and written."""
    rows_table = []
    for row, r in results.items():
        rows_table.append([label(row, r), f"{r['params']:,}", f"{r['median_step_s']:.3f}",
                           f"{r['s_per_step']:.3f}", f"{r['s_per_step'] * args.steps:.0f}",
                           f"{r['train_mb']:.0f}",
                           fmt(value_at_step(r["curve"], args.early_step)),
                           fmt(r["curve"][-1][2])])
    text = "Rows (held-out bits per byte):\n\n" + text_table(
        ["row", "params", "median s/step", "mean s/step", "train s", "train MB",
         f"bpb @{args.early_step}", f"bpb @{args.steps}"], rows_table, right=range(1, 8))

    ends = sorted({r["curve"][-1][1] for r in results.values()})
    front = [[f"{t:.0f}", d, fmt(dv), c, fmt(cv), fmt(cv - dv)]
             for t, d, dv, c, cv in time_frontier(results, ends)]
    text += ("\n\nWall-clock frontier, at each row's end time (a row that ended earlier counts "
             "with its final bpb):\n\n" + text_table(
                 ["seconds", "best dense", "bpb", "best compressed", "bpb", "compressed - dense"],
                 front, right=(0, 2, 4, 5)))

    mem = [[f"{mb:.0f}", d, fmt(dv), c, fmt(cv), fmt(cv - dv)]
           for mb, d, dv, c, cv in memory_frontier(results)]
    text += ("\n\nMemory frontier, at each row's training memory (final bpb of the best row "
             "that fits in it):\n\n" + text_table(
                 ["train MB", "best dense", "bpb", "best compressed", "bpb",
                  "compressed - dense"], mem, right=(0, 2, 4, 5)))

    equal = []
    for row, r in results.items():
        kind, width = parse_row(row)
        twin = results.get(f"dense@{width:g}")
        if is_dense(row) or twin is None:
            continue
        for step in (args.early_step, args.steps):
            gap = value_at_step(r["curve"], step) - value_at_step(twin["curve"], step)
            equal.append([label(row, r), f"dense@{width:g}", f"{r['params']:,}",
                          f"{twin['params']:,}", str(step), f"{gap:+.3f}"])
    if equal:
        text += ("\n\nEqual parameters, equal steps (compressed row - the dense row of its "
                 "parameter count; negative: the compressed row is ahead):\n\n" + text_table(
                     ["row", "dense of equal params", "params", "dense params", "step", "gap"],
                     equal, right=range(2, 6)))

    per_row, wins = verdicts(results)
    lines = [f"  {row}: ends at {end:.0f} s with {final:.3f} bpb; best dense then {d} at "
             f"{dv:.3f} ({gap:+.3f})" for row, end, final, d, dv, gap in per_row]
    if not per_row:
        verdict = ("Verdict: none yet: this run has no compressed row to set against a dense "
                   "one.")
    elif wins:
        best = per_row[0]
        verdict = (f"Verdict: a compressed configuration wins on the wall-clock frontier: "
                   f"{best[0]} ends at {best[1]:.0f} s {-best[5]:.3f} bpb below the best dense "
                   f"model at that time ({best[3]}).")
    else:
        best = per_row[0]
        verdict = (f"Verdict: no compressed configuration beats the best dense model at equal "
                   f"wall clock. The closest, {best[0]}, ends at {best[1]:.0f} s {best[5]:.3f} "
                   f"bpb above the best dense model at that time ({best[3]}).")
    if lines:
        text += ("\n\nEach compressed row against the dense frontier at its own end time:\n\n"
                 + "\n".join(lines))
    text += "\n\n" + verdict
    return text, wins


def corpus_name(args) -> str:
    """How the results name the corpus (never a machine path)."""
    return args.corpus_name or corpus_label(args.corpus)


def setup_line(args, rows: list[str]) -> str:
    sched = "constant" if args.schedule == "constant" else "cosine to a tenth"
    hidden = {w: dense_shape(args, w) for w in sorted({parse_row(r)[1] for r in rows})}
    widths = ", ".join(f"{w:g}: hidden {h}, FFN {f}, {n} heads" for w, (h, f, n) in
                       sorted(hidden.items(), reverse=True))
    return (f"LlamaForCausalLM, {args.layers} layers, byte vocabulary, sequence {args.seq}, "
            f"batch {args.batch}, {args.steps} AdamW steps (lr {args.lr}, {args.warmup} "
            f"warm-up steps, then {sched}), {args.threads} threads, corpus {corpus_name(args)}, "
            f"held-out bits per byte on files never trained on ({args.val_batches} batches, "
            f"every {args.eval_every} steps), one process per row. Widths ({widths}). "
            f"Compressed rows: optimize(budget=the dense row's parameter count, "
            f"compile={args.compile!r}), trained with param_groups(model, lr={args.lr}). "
            f"{CLOCKS[args.clock]} Training memory: peak RSS from just before the model is "
            "built to the end of training, minus the RSS then.")


CLOCKS = {
    "median": "Seconds (the frontier's clock): steps x the row's median training step "
              "(evaluations left out), so that a burst of other load on the shared machine, "
              "which slows some of a row's steps, does not move the row; the measured "
              "seconds are the 'train s' column and the raw curves.",
    "elapsed": "Seconds: measured training seconds (evaluations left out).",
}


def plot(results: dict, img_dir: Path, name: str, clock: str = "elapsed") -> list[Path]:
    """bpb against seconds (both frontiers bold, every row faint) and bpb against MB."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"dense": "tab:blue"}
    palette = iter(["tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"])
    for row in results:
        kind = parse_row(row)[0]
        if kind not in colours:
            colours[kind] = next(palette, "tab:gray")
    img_dir.mkdir(parents=True, exist_ok=True)
    paths = []

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for row, r in results.items():
        c = r["curve"]
        ax.plot([p[1] for p in c], [p[2] for p in c], color=colours[parse_row(row)[0]],
                alpha=0.3, lw=1)
        ax.annotate(row, (c[-1][1], c[-1][2]), fontsize=6, alpha=0.7)
    end = max(r["curve"][-1][1] for r in results.values())
    grid = [end * i / 400 for i in range(1, 401)]
    front = time_frontier(results, grid)
    ax.plot(grid, [f[2] for f in front], color="tab:blue", lw=2.5, label="dense frontier")
    ax.plot(grid, [f[4] for f in front], color="tab:red", lw=2.5,
            label="compressed frontier")
    finals = [r["curve"][-1][2] for r in results.values()]
    top = max(v for f in front[len(front) // 20:] for v in (f[2], f[4]) if not math.isnan(v))
    ax.set_ylim(min(finals) - 0.05, top + 0.05)
    ax.set_xlabel("training seconds" + (" (steps x the row's median step time)"
                                         if clock == "median" else ""))
    ax.set_ylabel("held-out bits per byte")
    ax.set_title("Pretraining frontier: best bpb reached by each second")
    ax.legend()
    paths.append(img_dir / f"{name}_time.png")
    fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for row, r in results.items():
        ax.scatter(r["train_mb"], r["curve"][-1][2], color=colours[parse_row(row)[0]], s=20)
        ax.annotate(row, (r["train_mb"], r["curve"][-1][2]), fontsize=6)
    mem = memory_frontier(results)
    mem.append((mem[-1][0] * 1.03, *mem[-1][1:]))  # the last level reaches the plot's edge
    for at, colour, family in ((2, "tab:blue", "dense"), (4, "tab:red", "compressed")):
        ax.step([m[0] for m in mem], [m[at] for m in mem], where="post", color=colour, lw=2,
                label=f"{family} frontier")
    ax.set_xlabel("training memory, MB (peak RSS over the run minus RSS before the model)")
    ax.set_ylabel("held-out bits per byte at the last step")
    ax.set_title("Memory frontier: best final bpb within each memory")
    ax.legend()
    paths.append(img_dir / f"{name}_memory.png")
    fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
    plt.close(fig)
    return paths


def retimed(results: dict, clock: str) -> dict:
    """The rows with their curves on the clock the report uses: ``"elapsed"``, the measured
    training seconds; ``"median"``, each step at the row's median step time, which a burst
    of other load on a shared machine (slowing some of a row's steps) leaves alone."""
    if clock == "elapsed":
        return results
    return {row: dict(r, curve=[(s, s * r["median_step_s"], v) for s, _, v in r["curve"]])
            for row, r in results.items()}


def race(args) -> None:
    notes: list[str] = []
    rows = plan_rows(args, notes)
    json_path = Path(args.json) if args.json else RESULTS_DIR / f"{args.results_name}.json"
    measured = run_rows(args, rows, json_path, notes)
    if not measured:
        raise SystemExit("no row ran")
    results = retimed(measured, args.clock)
    text, _ = report(args, results)
    if notes:
        text += "\n\nLeft out:\n" + "\n".join(f"  {n}" for n in notes)
    print(text)
    if args.no_write:
        return
    setup = setup_line(args, list(results))
    dates = json.loads(json_path.read_text()).get("dates", {}) if json_path.exists() else {}
    ran = sorted(d for r, d in dates.items() if r in results)
    if ran:
        held = ", each holding the benchmark lock" if args.lock else ""
        setup += f" Rows ran from {ran[0]} to {ran[-1]}{held}."
    if args.note:
        setup += f" {args.note}"
    if args.report_only:
        setup += (" This report reads the rows from the raw curves file; each row ran earlier, "
                  "in a process of its own, by this script with --rows and --resume.")
    body = (setup + "\n\n```\n" + text + "\n```\n\nRaw curves (step, seconds, bpb) and each "
            f"row's date: `benchmarks/results/{json_path.name}`.\n")
    print("wrote", write_results(args.results_name, "Pretraining frontier", body,
                                 out_dir=json_path.parent))
    if not args.no_plot:
        for path in plot(results, Path(args.img_dir), args.results_name, args.clock):
            print("plot:", path)


# ----- the GPU form -------------------------------------------------------------------------
def gpu_race(args) -> None:
    """Dense and the default, eager and compiled, at the 60M shape: speed, memory, quality."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--gpu needs CUDA (torch.cuda.is_available() is False); "
                         "--device cpu runs the same code on the CPU")
    rows = [r.strip() for r in (args.rows or ",".join(GPU_ROWS)).split(",") if r.strip()]
    unknown = set(rows) - set(GPU_ROWS)
    if unknown:
        raise SystemExit(f"unknown GPU rows {sorted(unknown)}; choose from {GPU_ROWS}")
    results, failed = {}, []
    for row in rows:
        cmd = [sys.executable, __file__, *args.argv, "--row", row]
        t0 = time.time()
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            print(out.stderr[-3000:])
            last = (out.stderr.strip().splitlines() or ["no message"])[-1]
            failed.append(f"{row} failed (left out): {last[:300]}")
            print(failed[-1])
            continue
        results[row] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{row}: {results[row]['median_step_s'] * 1e3:.1f} ms/step "
              f"({time.time() - t0:.0f} s)", flush=True)
    if not results:
        raise SystemExit("no GPU row ran")
    text = "\n".join([gpu_report(args, results), *failed])
    print(text)
    if not args.no_write:
        where = "GPU " + torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
        body = (f"LlamaForCausalLM {args.layers} x {args.hidden} (FFN {args.ffn}, {args.heads} "
                f"heads), vocabulary {args.vocab} (byte tokens of {corpus_name(args)} fill the "
                f"first 256), sequence {args.seq}, batch {args.batch}, "
                f"{'bf16 autocast' if args.bf16 else 'fp32'}, AdamW lr {args.lr}, "
                f"{args.steps} steps; on {where}; default: optimize(budget={args.budget}); "
                "compiled: the default with the comera backend (CUDA Graph trees on CUDA), "
                "dense with torch.compile; one process per row. Step time: the median step; "
                "first step: compiles included.\n\n```\n" + text + "\n```\n")
        print("wrote", write_results(args.results_name, "Pretraining on a GPU", body))


def gpu_report(args, results: dict) -> str:
    base = results.get("dense")
    clock = min(r["curve"][-1][1] for r in results.values())
    table = []
    for row, r in results.items():
        mem = r["cuda_peak_mb"] if r["cuda_peak_mb"] is not None else r["train_mb"]
        vs = (f"{base['median_step_s'] / r['median_step_s']:.2f}x" if base else "-")
        base_mem = base and (base["cuda_peak_mb"] or base["train_mb"])
        table.append([label(row, r), f"{r['params']:,}", f"{r['first_step_s']:.1f}",
                      f"{r['median_step_s'] * 1e3:.1f}", f"{r['tokens_per_s']:,.0f}",
                      f"{mem:.0f}", vs, f"{mem / base_mem:.2f}x" if base_mem else "-",
                      fmt(r["curve"][-1][2]), fmt(value_at(r["curve"], clock))])
    return text_table(["row", "params", "first step s", "ms/step", "tokens/s", "peak MB",
                       "speed vs dense", "memory vs dense", f"bpb @{args.steps}",
                       f"bpb @{clock:.0f} s"], table, right=range(1, 10))


# ----- command line -------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu", action="store_true",
                   help="the GPU form: 60M shape, bf16, dense and default, eager and compiled")
    p.add_argument("--device", default=None, help="cuda with --gpu, else cpu")
    p.add_argument("--rows", default=None,
                   help="explicit rows, e.g. dense@1,dense@0.5,default@0.5 (GPU: "
                        f"{','.join(GPU_ROWS)})")
    p.add_argument("--widths", default="1,0.75,0.5,0.25", help="dense widths")
    p.add_argument("--match", default="0.75,0.5,0.25",
                   help="widths whose parameter counts the compressed rows match")
    p.add_argument("--formats", default=",".join(FORMATS),
                   help="compressed rows (default: optimize's own choice)")
    for name in ("layers", "hidden", "ffn", "heads", "seq", "batch", "vocab", "steps"):
        p.add_argument(f"--{name}", type=int, default=None,
                       help=f"default {CPU_SHAPE[name]} (--gpu: {GPU_SHAPE[name]})")
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--schedule", choices=("constant", "cosine"), default="constant",
                   help="after the warm-up")
    p.add_argument("--clock", choices=("median", "elapsed"), default="median",
                   help="the frontier's seconds: steps x the row's median step time, or the "
                        "measured training seconds (on a machine of steady load the two agree)")
    p.add_argument("--budget", type=float, default=0.25, help="--gpu: the default's budget")
    p.add_argument("--compile", action="store_true",
                   help="compressed rows with optimize's measured compile (default: eager)")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 autocast (default: on with --gpu)")
    p.add_argument("--corpus", default=STDLIB,
                   help="a text file or a folder of source/text files (default: Python's "
                        "standard library source)")
    p.add_argument("--corpus-name", default=None, help="how the results name the corpus")
    p.add_argument("--corpus-bytes", type=int, default=8_000_000)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--early-step", type=int, default=300,
                   help="the earlier step of the equal-steps comparison")
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--threads", type=int, default=None, help="default 2 (--gpu: 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lock", default=None,
                   help="a file whose flock each row holds while it runs (other benchmarks "
                        "time between rows)")
    p.add_argument("--resume", action="store_true",
                   help="keep rows of the same setup already in the JSON file")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: report the rows of the JSON file (with --resume)")
    p.add_argument("--results-name", default=None,
                   help="results/NAME.md and .json (default frontier, --gpu frontier_cuda)")
    p.add_argument("--json", default=None, help="raw curves file (default results/NAME.json)")
    p.add_argument("--img-dir", default=str(ROOT / "docs" / "img"))
    p.add_argument("--note", default="", help="a sentence the report's setup line ends with "
                   "(how the rows ran, where that matters to their clock)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--row", default=None, help=argparse.SUPPRESS)
    p.set_defaults(uniform_lr=False)  # pretrain.optimizer_for's ablation, off
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what each row's process gets
    preset = GPU_SHAPE if args.gpu else CPU_SHAPE
    for name, value in preset.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.device = args.device or ("cuda" if args.gpu else "cpu")
    args.threads = args.threads or (8 if args.gpu else 2)
    args.bf16 = args.gpu if args.bf16 is None else args.bf16
    args.results_name = args.results_name or ("frontier_cuda" if args.gpu else "frontier")
    args.corpus_name = corpus_name(args)
    args.resume = args.resume or args.report_only
    if args.eval_every < 1 or args.steps < 1:
        raise SystemExit("--steps and --eval-every must be at least 1")
    if args.hidden % args.heads:
        raise SystemExit(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.row:
        print(json.dumps(run_row(args)))
    elif args.gpu:
        gpu_race(args)
    else:
        race(args)


if __name__ == "__main__":
    main()
