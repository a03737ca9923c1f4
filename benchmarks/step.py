"""Training step time and training memory of the six-encoder: dense, GaLore and CoMERA.

One child process per row (so no row inherits another's memory or compiled code):
dense eager, dense + inductor, GaLore (``galore-torch``, rank 128, as its README sets it),
CoMERA eager, CoMERA compiled (``backend="comera"``), CoMERA compiled + ``memory="low"``.
A step is forward + cross-entropy + backward + optimizer step (AdamW, lr 1e-4, no weight
decay; dropout 0.1, train mode). Every AdamW row runs torch's fused AdamW
(``fused=True``, one kernel over all tensors: a compressed model has hundreds of small ones);
``--optimizer for-loop`` or ``foreach`` picks torch's other implementations. GaLore runs its
own AdamW, as its README sets it. Step time is the median of ``--steps`` steps after
``--warmup`` steps (compilation happens in the warm-up). Training memory is the peak RSS
during the timed steps (the kernel's high-water mark, reset before them; sampled every 5 ms
where the reset is refused) minus the RSS of the process before the model is built (on
CUDA: the most memory the caching allocator held, ``torch.cuda.max_memory_reserved``,
over the whole run: CUDA Graph trees keep a replayed step's activations in a private pool
whose blocks count as free between replays, so the allocated peak would miss them).
Page faults are the minor faults of the process per timed step (``getrusage``): each
is a 4 KiB page of a freshly mapped block touched for the first time. The compiled
CoMERA rows keep freed blocks of 1 MiB or more by size for reuse (they ask for
``host_memory="cache"``, the block cache, an opt-in of the backend: its default leaves the
allocator alone); the other rows keep glibc's own defaults. ``--host-memory cache``, ``reuse`` or
``release`` sets that allocator in every row, so rows can be compared on equal terms (the
allocator's own share of a gain).

    pip install galore-torch            # for the GaLore row (skipped when missing)
    python benchmarks/step.py                       # batch 1 x 128 and 32 x 128
    python benchmarks/step.py --batches 8 --rows comera-eager,comera-compiled
    python benchmarks/step.py --batches 32 --rows comera-eager,comera-compiled --host-memory cache
    python benchmarks/step.py --batches 8 --rows comera-compiled --host-memory release
    python benchmarks/step.py --batches 32 --rounds 3 \
        --rows dense-inductor,comera-compiled,comera-compiled-low

Step times on a shared CPU drift by 10-20% from one process to the next. ``--rounds N``
runs the whole list of rows N times, one round after the other (each row's child once per
round), and prints each row's median over the rounds with its range, and the ratios the
targets name (compiled against eager and against dense + inductor, CoMERA against GaLore,
low memory against compiled and against dense) taken within each round, where both rows
ran minutes apart, then their median.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time

ROWS = (
    "dense-eager",
    "dense-inductor",
    "galore",
    "comera-eager",
    "comera-compiled",
    "comera-compiled-low",
)


def rss_bytes() -> int:
    """Resident set size of this process, from /proc (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """The peak RSS while active: the kernel's own high-water mark (``VmHWM``), reset on
    entry through ``/proc/self/clear_refs``, so no short peak is missed. Where that reset
    is refused, a thread samples the RSS every few milliseconds instead (it can miss a
    peak shorter than its period); ``exact`` says which one measured."""

    def __init__(self, period: float = 0.005) -> None:
        self.period, self.peak, self._stop = period, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.exact = False

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.period)

    def __enter__(self) -> PeakRss:
        self.peak = rss_bytes()
        self.exact = _reset_high_water_mark()
        if not self.exact:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.exact:
            self.peak = max(self.peak, _high_water_mark())
        else:
            self._stop.set()
            self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def _reset_high_water_mark() -> bool:
    """Set the kernel's peak-RSS mark to the current RSS (Linux 4.0+); False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _high_water_mark() > 0
    except OSError:
        return False


def _high_water_mark() -> int:
    """``VmHWM`` from /proc/self/status, in bytes (0 where absent)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def galore_optimizer(model, lr: float):
    """GaLore AdamW on the encoder's 2-d attention and FFN weights (rank 128, projection
    refreshed every 200 steps, scale 0.25), plain AdamW groups for everything else."""
    from galore_torch import GaLoreAdamW

    galore = [
        p for name, p in model.named_parameters()
        if p.dim() == 2 and ".layers." in f".{name}" and ("attention" in name or "ffn" in name)
    ]
    ids = {id(p) for p in galore}
    rest = [p for p in model.parameters() if id(p) not in ids]
    groups = [
        {"params": rest},
        {"params": galore, "rank": 128, "update_proj_gap": 200, "scale": 0.25,
         "proj_type": "std"},
    ]
    return GaLoreAdamW(groups, lr=lr, weight_decay=0.0)


def run_row(row: str, batch: int, seq: int, layers: int, steps: int, warmup: int,
            host_memory: str = "default", low_memory: str | float = "low",
            optimizer_impl: str = "fused") -> dict:
    """Build, warm up and time one row in this process; returns its measurements."""
    import torch
    import torch.nn.functional as F

    from comera_compile.cli.six_encoder import (
        SixEncoderClassifier,
        SixEncoderConfig,
        reference_tensorized,
    )
    from comera_compile.compile import compile_model
    from comera_compile.compile.cpu.host_memory import set_host_memory

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if host_memory != "default":
        set_host_memory(host_memory)
    g = torch.Generator().manual_seed(0)
    config = SixEncoderConfig(layers=layers)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=g).to(device)
    labels = torch.randint(0, config.num_labels, (batch,), generator=g).to(device)
    base = rss_bytes()
    torch.manual_seed(0)
    dense = row in ("dense-eager", "dense-inductor", "galore")
    model = (SixEncoderClassifier(config) if dense else reference_tensorized(config))
    model = model.to(device).train()
    if row == "galore":
        optimizer = galore_optimizer(model, 1e-4)
    else:
        impl = {"fused": {"fused": True}, "foreach": {"foreach": True},
                "for-loop": {"foreach": False}}[optimizer_impl]
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, **impl)
    forward = model
    # "default": the compiled rows opt in to the block cache (the backend's own default,
    # "off", leaves the process's allocator alone)
    released = {"host_memory": host_memory if host_memory != "default" else "cache"}
    if row == "dense-inductor":
        forward = torch.compile(model, backend="inductor")
    elif row == "comera-compiled":
        forward = compile_model(model, **released)
    elif row == "comera-compiled-low":
        forward = compile_model(model, memory=low_memory, **released)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(forward(ids), labels).backward()
        optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()

    start = time.perf_counter()
    for _ in range(warmup):
        step()
    warm = time.perf_counter() - start
    times = []
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    with PeakRss() as peak:
        for _ in range(steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / steps
    memory = (
        torch.cuda.max_memory_reserved() if device == "cuda" else peak.peak - base
    )
    return {
        "row": row,
        "batch": batch,
        "ms": statistics.median(times) * 1e3,
        "warmup_s": warm,
        "memory_mb": memory / 2**20,
        "faults": faults,
        "peak": "high-water mark" if peak.exact else "sampled every 5 ms",
        "params": sum(p.numel() for p in model.parameters()),
    }


def child(args: argparse.Namespace, row: str, batch: int) -> dict | str:
    """Run one row in a fresh interpreter; its result, or why it failed."""
    cmd = [
        sys.executable, __file__, "--child", row, "--batches", str(batch), "--seq",
        str(args.seq), "--layers", str(args.layers), "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--threads", str(args.threads),
        "--host-memory", args.host_memory, "--low-memory", args.low_memory,
        "--optimizer", args.optimizer,
    ]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if args.huge_pages:  # read by torch's CPU allocator at its first allocation
        env["THP_MEM_ALLOC_ENABLE"] = "1"
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (done.stderr or done.stdout).strip().splitlines()
    return tail[-1][:80] if tail else f"exit code {done.returncode}"


def table(results: list[dict], batch: int) -> str:
    mine = {r["row"]: r for r in results if r["batch"] == batch}
    lines = [
        f"batch {batch} x seq: {'row':20s} {'ms/step':>9s} {'memory MB':>10s} "
        f"{'speed/dense':>11s} {'mem/dense':>9s} {'speed/GaLore':>12s} {'mem/GaLore':>10s} "
        f"{'faults/step':>11s}"
    ]
    dense, galore = mine.get("dense-eager"), mine.get("galore")

    def ratio(ref, r, key):
        return f"{ref[key] / r[key]:.2f}x" if ref and r[key] > 0 else "-"

    for name in ROWS:
        r = mine.get(name)
        if r is None:
            continue
        lines.append(
            f"{'':13s}{name:20s} {r['ms']:9.1f} {r['memory_mb']:10.1f} "
            f"{ratio(dense, r, 'ms'):>11s} {ratio(dense, r, 'memory_mb'):>9s} "
            f"{ratio(galore, r, 'ms'):>12s} {ratio(galore, r, 'memory_mb'):>10s} "
            f"{r['faults']:11,.0f}"
        )
    return "\n".join(lines)


PAIRS = (  # (row, reference, what the ratio says)
    ("comera-compiled", "comera-eager", "speed-up"),
    ("comera-compiled", "dense-inductor", "speed-up"),
    ("comera-compiled", "galore", "speed-up"),
    ("comera-eager", "galore", "speed-up"),
    ("comera-eager", "galore", "memory cut"),
    ("comera-compiled-low", "comera-compiled", "extra time"),
    ("comera-compiled-low", "dense-eager", "memory cut"),
)


def median_over_rounds(rounds: list[list[dict]]) -> list[dict]:
    """One result per (batch, row): the median step time and memory over the rounds, with
    their ranges (``ms_range``, ``memory_range``)."""
    merged: dict[tuple[int, str], list[dict]] = {}
    for results in rounds:
        for r in results:
            merged.setdefault((r["batch"], r["row"]), []).append(r)
    out = []
    for runs in merged.values():
        r = dict(runs[0])
        for key in ("ms", "memory_mb", "faults"):
            r[key] = statistics.median(x[key] for x in runs)
        r["ms_range"] = (min(x["ms"] for x in runs), max(x["ms"] for x in runs))
        r["memory_range"] = (min(x["memory_mb"] for x in runs),
                             max(x["memory_mb"] for x in runs))
        r["rounds"] = len(runs)
        out.append(r)
    return out


def paired_ratios(rounds: list[list[dict]], batch: int) -> list[str]:
    """The targets' ratios, each taken within a round (the two rows ran minutes apart in
    one round), then the median and range over the rounds."""
    lines = []
    for row, ref, what in PAIRS:
        values = []
        for results in rounds:
            mine = {r["row"]: r for r in results if r["batch"] == batch}
            if row in mine and ref in mine:
                a, b = mine[row], mine[ref]
                if what == "speed-up":
                    values.append(b["ms"] / a["ms"])
                elif what == "extra time":
                    values.append(a["ms"] / b["ms"] - 1)
                else:
                    values.append(b["memory_mb"] / a["memory_mb"])
        if not values:
            continue
        fmt = (lambda v: f"{v:+.1%}") if what == "extra time" else (lambda v: f"{v:.2f}x")
        lines.append(f"  {what} of {row} over {ref}: {fmt(statistics.median(values))} "
                     f"(median of {len(values)} round(s): "
                     f"{', '.join(fmt(v) for v in values)})")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch default)")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--host-memory", choices=("default", "cache", "reuse", "release"),
                        default="default",
                        help="cache: every row keeps freed blocks by size (block cache); "
                             "reuse: every row keeps freed host memory in glibc's heap; "
                             "release: every row hands it back to the OS at once")
    parser.add_argument("--low-memory", default="low",
                        help="the memory setting of the comera-compiled-low row: 'low' or an "
                             "activation budget in (0, 1]")
    parser.add_argument("--huge-pages", action="store_true",
                        help="every row allocates blocks of 2 MiB and more on transparent huge "
                             "pages (torch's THP_MEM_ALLOC_ENABLE=1)")
    parser.add_argument("--optimizer", choices=("fused", "foreach", "for-loop"),
                        default="fused",
                        help="torch's AdamW implementation in every row but GaLore's")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the list of rows this many times, round after round, and "
                             "report medians and paired ratios over the rounds")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per row")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.child:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        low_memory = args.low_memory if args.low_memory == "low" else float(args.low_memory)
        print(json.dumps(run_row(args.child, batches[0], args.seq, args.layers, args.steps,
                                 args.warmup, args.host_memory, low_memory,
                                 args.optimizer)))
        return

    from tqdm import tqdm

    from comera_compile.cli.machine import describe_machine

    print(describe_machine())
    rows = [r for r in args.rows.split(",") if r]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; choose from {list(ROWS)}")
    print(
        f"six-encoder, {args.layers} layers, seq {args.seq}; median of {args.steps} steps "
        f"after {args.warmup} warm-up steps; one child process per row"
        + (f", {args.rounds} rounds (medians over rounds)" if args.rounds > 1 else "")
        + (f" with {args.threads} thread(s)" if args.threads else "")
        + {"default": "", "cache": "; every row keeps freed blocks by size (block cache)",
           "reuse": "; every row reuses freed host memory in the heap",
           "release": "; every row releases freed host memory at once"}[args.host_memory]
        + ("; huge pages (THP_MEM_ALLOC_ENABLE=1)" if args.huge_pages else "")
        + (f"; low-memory row: memory={args.low_memory}" if args.low_memory != "low" else "")
        + f"; AdamW: {args.optimizer}"
    )
    rounds: list[list[dict]] = [[] for _ in range(args.rounds)]
    jobs = [(n, b, r) for n in range(args.rounds) for b in batches for r in rows]
    for n, batch, row in tqdm(jobs, desc="rows", file=sys.stderr):
        out = child(args, row, batch)
        if isinstance(out, str):
            tqdm.write(f"  batch {batch} {row}: skipped ({out})", file=sys.stderr)
            continue
        rounds[n].append(out)
        tqdm.write(
            f"  {f'round {n + 1}: ' if args.rounds > 1 else ''}batch {batch} {row}: "
            f"{out['ms']:.1f} ms/step, {out['memory_mb']:.1f} MB, "
            f"{out['faults']:,.0f} page faults/step (warm-up {out['warmup_s']:.0f} s)",
            file=sys.stderr,
        )
    results = median_over_rounds(rounds) if args.rounds > 1 else rounds[0]
    for batch in batches:
        print(table(results, batch))
        if args.rounds > 1:
            for r in results:
                if r["batch"] == batch:
                    lo, hi = r["ms_range"]
                    mlo, mhi = r["memory_range"]
                    print(f"  {r['row']}: {lo:.1f}-{hi:.1f} ms/step, {mlo:.1f}-{mhi:.1f} MB "
                          f"over {r['rounds']} rounds")
        print("\n".join(paired_ratios(rounds, batch)))
    peaks = sorted({r["peak"] for r in results})
    if peaks:
        print(f"peak RSS: {', '.join(peaks)}")


if __name__ == "__main__":
    main()
