"""Structured-layer peers at equal parameters: speed and accuracy side by side, in one run.

    pip install -e ".[peers]"                # tensorly-torch, scikit-learn, tqdm
    python benchmarks/peers.py               # a few minutes on 2 idle CPU cores
    python benchmarks/peers.py --quick       # fewer steps and repeats

For each compression level (4x, 16x, 64x fewer weights than ``nn.Linear``), every format is
sized to its largest setting with at most that many weights (cores, factors and rank gates;
biases aside):

- dense ``nn.Linear``;
- ``TTLinear`` order 3 and order 2 (modes per side), and ``LowRankLinear`` (``W = U V``,
  the TT with one mode per side: LoRA / CoLA-style low rank);
- BTT: a block tensor-train layer (two block-diagonal factors with a transpose between
  them; rank 1 is Monarch). Our own implementation of the published structure (Qiu et
  al., "Compute Better Spent", 2024; Dao et al., "Monarch", 2022), written here;
- tensorly-torch's ``FactorizedLinear`` with ``factorization="blocktt"`` (its TT-matrix),
  with the factorized and the reconstructed forward, if the package is installed. Its
  ``FactorizedLinear`` offers no plain TT (its TT is for tensors, not linear maps), so
  there is no tensorly-torch TT row.

Columns: forward + backward time of one 768x768 layer at 32 / 512 / 4096 input rows (median;
"x" = speed-up over nn.Linear), and test accuracy after the same number of training steps
(same data, optimizer and learning rate for every format) on two tasks where every hidden
Linear is replaced: the synthetic sentence-pair task (a 2-layer, 64-wide encoder, batch 32) and
scikit-learn's digits (a 64-256-256-10 MLP, head dense, batch 64). The step counts are small so the
whole run fits in minutes on a CPU: the accuracies rank the formats, they are not converged.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import forward_backward, median_seconds, table  # noqa: E402

from comera_compile.cli.machine import describe_machine  # noqa: E402
from comera_compile.cli.pair_task import PairTask  # noqa: E402
from comera_compile.cli.six_encoder import SixEncoderClassifier, SixEncoderConfig  # noqa: E402
from comera_compile.formats import factorize  # noqa: E402
from comera_compile.nn import LowRankLinear, TTLinear  # noqa: E402

LEVELS = (4, 16, 64)
ROWS = (32, 512, 4096)
TIMED_SHAPE = (768, 768)


# ----- a block tensor-train (BTT / Monarch) layer ------------------------------------------
class BlockTTLinear(nn.Module):
    """Our implementation of the block tensor-train structure (BTT; Monarch at rank 1).

    With ``in = n1 * n2`` and ``out = m1 * m2``: a block-diagonal factor maps each of the
    ``n1`` input blocks (``n2`` wide) to ``m2 * rank`` values; after a transpose, a second
    block-diagonal factor maps each of the ``m2`` groups (``n1 * rank`` wide) to ``m1``
    outputs. Weights: ``rank * n1 * m2 * (n2 + m1)``. Two batched matmuls, no dense weight.
    """

    def __init__(self, in_features: int, out_features: int, n1: int, m2: int, rank: int,
                 bias: bool = True) -> None:
        super().__init__()
        if in_features % n1 or out_features % m2:
            raise ValueError(f"n1={n1} must divide {in_features} and m2={m2} {out_features}")
        self.n1, self.n2, self.m2, self.m1 = n1, in_features // n1, m2, out_features // m2
        self.rank, self.in_features, self.out_features = rank, in_features, out_features
        # output variance as nn.Linear's default init: 1/3 of the input variance
        self.right = nn.Parameter(torch.randn(n1, self.n2, m2 * rank) / math.sqrt(self.n2))
        self.left = nn.Parameter(torch.randn(m2, n1 * rank, self.m1) / math.sqrt(3 * n1 * rank))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        lead, rows = x.shape[:-1], x.shape[:-1].numel()
        z = torch.bmm(x.reshape(rows, self.n1, self.n2).transpose(0, 1), self.right)
        z = z.reshape(self.n1, rows, self.m2, self.rank).permute(2, 1, 0, 3)
        y = torch.bmm(z.reshape(self.m2, rows, self.n1 * self.rank), self.left)
        y = y.transpose(0, 1).reshape(*lead, self.out_features)
        return y + self.bias if self.bias is not None else y


# ----- sizing every format to a weight budget ----------------------------------------------
def weights(layer: nn.Module) -> int:
    """Parameters other than the bias and our rank gates (one scalar per rank channel, which
    could be folded into the cores; the peers have none)."""
    bias = getattr(layer, "bias", None)
    skip = [bias] if bias is not None else []
    skip += list(getattr(layer, "gates", []))
    return sum(p.numel() for p in layer.parameters()) - sum(p.numel() for p in skip)


def largest(build: Callable[[int], nn.Module], budget: int, hi: int = 4096) -> nn.Module | None:
    """``build(k)`` at the largest ``k`` (a rank) whose weights fit ``budget``."""
    if weights(build(1)) > budget:
        return None
    lo = 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if weights(build(mid)) <= budget else (lo, mid - 1)
    return build(lo)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def btt(fan_in: int, fan_out: int, budget: int) -> BlockTTLinear | None:
    """The BTT with most weights within ``budget``; ties go to the most balanced blocks."""
    best, key = None, None
    for n1 in _divisors(fan_in):
        for m2 in _divisors(fan_out):
            unit = n1 * m2 * (fan_in // n1 + fan_out // m2)
            rank = budget // unit
            if rank < 1:
                continue
            balance = abs(math.log(n1 * n1 / fan_in)) + abs(math.log(m2 * m2 / fan_out))
            k = (rank * unit, -balance)
            if key is None or k > key:
                best, key = (n1, m2, rank), k
    return None if best is None else BlockTTLinear(fan_in, fan_out, *best)


def _tltorch_blocktt(implementation: str):
    def build(fan_in: int, fan_out: int, budget: int) -> nn.Module | None:
        from tltorch import FactorizedLinear

        ins, outs = factorize(fan_in, 3).modes, factorize(fan_out, 3).modes
        if math.prod(ins) != fan_in or math.prod(outs) != fan_out:
            return None

        def make(rank: int) -> nn.Module:
            torch.manual_seed(0)
            return FactorizedLinear(ins, outs, factorization="blocktt", rank=rank,
                                    implementation=implementation)

        return largest(make, budget, hi=512)

    return build


def tltorch_status() -> str | None:
    """None when tensorly-torch imports, else why not (printed instead of its rows)."""
    try:
        import tltorch  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - report any import failure as it is
        return f"tensorly-torch unavailable ({type(exc).__name__}: {exc}); pip install " \
               "tensorly-torch tensorly"
    return None


@dataclass
class Format:
    name: str
    build: Callable[[int, int, int], nn.Module | None]  # (in, out, weight budget) -> layer


FORMATS = [
    Format("TT order 3", lambda i, o, b: largest(lambda r: TTLinear(i, o, r, order=3), b)),
    Format("TT order 2", lambda i, o, b: largest(lambda r: TTLinear(i, o, r, order=2), b)),
    Format("low-rank", lambda i, o, b: largest(lambda r: LowRankLinear(i, o, r), b)),
    Format("BTT (ours)", btt),
]
TLTORCH = [
    Format("tltorch BlockTT fact.", _tltorch_blocktt("factorized")),
    Format("tltorch BlockTT recon.", _tltorch_blocktt("reconstructed")),
]


def setting(layer: nn.Module) -> str:
    """Rank / block settings in a few characters."""
    if isinstance(layer, BlockTTLinear):
        return f"b{layer.n1}x{layer.m2} r{layer.rank}"
    if isinstance(layer, TTLinear):
        return f"r{max(layer.ranks)}"
    rank = getattr(getattr(layer, "weight", None), "rank", None)
    return f"r{max(rank)}" if rank is not None else ""


# ----- speed -------------------------------------------------------------------------------
def layer_times(layer: nn.Module, repeats: int, cpu_time: bool = False) -> list[float]:
    """Median forward + backward seconds at each row count. ``cpu_time`` counts the calling
    thread's CPU time instead of wall time (run with one torch thread): on a machine shared
    with other jobs it leaves out the time the process waits for a core."""
    out = []
    for rows in ROWS:
        x = torch.randn(rows, layer.in_features if hasattr(layer, "in_features") else 768)
        run = forward_backward(layer, (x,))
        if not cpu_time:
            out.append(median_seconds(run, repeats, warmup=1))
            continue
        run()
        times = []
        for _ in range(repeats):
            start = time.thread_time()
            run()
            times.append(time.thread_time() - start)
        out.append(statistics.median(times))
    return out


# ----- accuracy ----------------------------------------------------------------------------
def replace_linears(model: nn.Module, make: Callable[[int, int], nn.Module], skip: set[str]):
    """Swap every nn.Linear not in ``skip`` for ``make(in, out)`` (bias kept)."""
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and name not in skip:
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, make(module.in_features,
                                                            module.out_features))
    return model


def _train(model: nn.Module, batches: Callable[[int], tuple], steps: int, lr: float) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for step in range(steps):
        *inputs, labels = batches(step)
        loss = F.cross_entropy(model(*inputs), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    model.eval()


def pair_accuracy(make, steps: int, seed: int = 0) -> float:
    task = PairTask()
    config = SixEncoderConfig(vocab_size=task.vocab_size, hidden=64, ffn=128, heads=4,
                              layers=2, max_position=task.seq_len, dropout=0.0)
    torch.manual_seed(seed)
    model = replace_linears(SixEncoderClassifier(config), make, {"fc2"})
    generator = torch.Generator().manual_seed(seed + 1)
    _train(model, lambda _: task.batch(32, generator), steps, lr=3e-3)
    ids, types, labels = task.batch(2048, torch.Generator().manual_seed(12345))
    with torch.no_grad():
        return 100.0 * (model(ids, types).argmax(-1) == labels).float().mean().item()


def _digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    test, train = order[:360], order[360:]
    return x[train], y[train], x[test], y[test]


def digits_accuracy(make, steps: int, seed: int = 0) -> float:
    x, y, x_test, y_test = _digits()
    torch.manual_seed(seed)
    dense = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 10))
    model = replace_linears(dense, make, {"4"})
    generator = torch.Generator().manual_seed(seed + 1)

    def batch(_: int):
        pick = torch.randint(0, len(y), (64,), generator=generator)
        return x[pick], y[pick]

    _train(model, batch, steps, lr=2e-3)
    with torch.no_grad():
        return 100.0 * (model(x_test).argmax(-1) == y_test).float().mean().item()


# ----- the table ---------------------------------------------------------------------------
OVER_BUDGET: set[str] = set()  # formats that had a layer above their level's weights


def at_level(fmt: Format, level: int) -> Callable[[int, int], nn.Module]:
    """The format's layer for any shape at ``level`` x fewer weights than dense; where the
    format cannot get that small, its smallest setting (within 2x), flagged in the table."""
    def make(fan_in: int, fan_out: int) -> nn.Module:
        budget = fan_in * fan_out // level
        layer = fmt.build(fan_in, fan_out, budget)
        while layer is None and budget < fan_in * fan_out:
            budget *= 2
            layer = fmt.build(fan_in, fan_out, budget)
            OVER_BUDGET.add(f"{fmt.name} at {level}x")
        if layer is None:
            raise ValueError(f"{fmt.name} has no setting below dense for {fan_in}x{fan_out}")
        return layer

    return make


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats")
    parser.add_argument("--pair-steps", type=int, default=None)
    parser.add_argument("--digits-steps", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per cell")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time CPU seconds of one thread (for a machine shared with others)")
    args = parser.parse_args()
    repeats = args.repeats or (3 if args.quick else 5)
    default_steps = 60 if args.quick else 200
    pair_steps = default_steps if args.pair_steps is None else args.pair_steps  # 0: skip
    digits_steps = default_steps if args.digits_steps is None else args.digits_steps
    if args.cpu_time:
        torch.set_num_threads(1)
    print(describe_machine())
    clock = "CPU time of one thread" if args.cpu_time else "wall time"
    print(f"forward + backward of one {TIMED_SHAPE[0]}x{TIMED_SHAPE[1]} layer, {clock}, median of "
          f"{repeats}, ms (speed-up over nn.Linear); test accuracy after {pair_steps} pair-task "
          f"steps and {digits_steps} digits steps (short runs: not converged; 0 = skipped)")
    formats = list(FORMATS)
    missing = tltorch_status()
    if missing:
        print(missing)
    else:
        formats += TLTORCH
    torch.manual_seed(0)

    jobs = [("dense", 1, lambda i, o: nn.Linear(i, o))]
    jobs += [(f.name, level, at_level(f, level)) for level in LEVELS for f in formats]
    rows = []
    for name, level, make in tqdm(jobs, desc="formats", file=sys.stdout):
        try:
            layer = make(*TIMED_SHAPE)
        except ValueError as exc:
            tqdm.write(f"  {exc}")
            continue
        times = layer_times(layer, repeats, args.cpu_time)
        if name == "dense":
            dense_times = times
        OVER_BUDGET.discard(f"{name} at {level}x")
        pair = pair_accuracy(make, pair_steps) if pair_steps else None
        digits = digits_accuracy(make, digits_steps) if digits_steps else None
        flag = "*" if f"{name} at {level}x" in OVER_BUDGET else ""
        rows.append([
            f"{level}x", name, setting(layer) or "-", f"{weights(layer):,}",
            *(f"{t * 1e3:.2f} ({d / t:.1f}x)" for t, d in zip(times, dense_times)),
            "-" if pair is None else f"{pair:.1f}{flag}",
            "-" if digits is None else f"{digits:.1f}{flag}",
        ])
        tqdm.write("  " + " | ".join(rows[-1]))  # partial results survive an interruption
    print()
    print(table(rows, ["level", "format", "setting", "weights", *(f"{r} rows" for r in ROWS),
                       "pair acc %", "digits acc %"]))
    if OVER_BUDGET:
        print("* some layers of the task models at the format's smallest setting (up to 2x), "
              "above the level's weights: " + ", ".join(sorted(OVER_BUDGET)))


if __name__ == "__main__":
    main()
