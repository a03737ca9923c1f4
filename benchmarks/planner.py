"""Planned contraction order vs the CoMERA paper's fixed order vs nn.Linear, side by side.

    python benchmarks/planner.py            # full grid
    python benchmarks/planner.py --quick    # ranks 16/30, fewer batch sizes and repeats

For TTLinear and TTMLinear at 768x768 and 768x3072, ranks 8/16/30 and batch 1..4096:
forward + backward time of the planned layer (autotuned), of the fixed order (TT: merge
input cores, merge output cores, two matmuls; TTM: sweep the input through the cores) and
of nn.Linear. "planned/fixed" below 1 means the planner is faster. Also the uncached
planning time per layer.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import forward_backward, median_seconds, table  # noqa: E402

from comera_compile import TTLinear, TTMLinear  # noqa: E402
from comera_compile.cli.machine import describe_machine  # noqa: E402
from comera_compile.planner import (  # noqa: E402
    clear_memory_cache,
    get_plan,
    plan_network,
    tt_linear_network,
)


def planning_ms(layer, rows: int) -> float:
    """Uncached planning time (no memory or disk cache), median of 5."""
    times = []
    for _ in range(5):
        clear_memory_cache()
        start = time.perf_counter()
        plan_network(layer._network(rows))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def cache_hit_us(calls: int = 20000) -> float:
    """Time of one in-memory plan cache hit (what every layer forward pays), in us."""
    net = tt_linear_network([12, 8, 8], [8, 8, 12], 16, 5)
    get_plan(net, dtype=torch.float32, device_type="cpu")
    start = time.perf_counter()
    for _ in range(calls):
        get_plan(net, dtype=torch.float32, device_type="cpu")
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    ranks = (16, 30) if args.quick else (8, 16, 30)
    batches = (1, 32, 512, 4096) if args.quick else (1, 8, 32, 128, 512, 2048, 4096)
    repeats = 3 if args.quick else 7
    print(describe_machine())
    torch.manual_seed(0)
    rows, worst, plan_times = [], 0.0, []
    shapes = ((768, 768), (768, 3072))
    cases = list(itertools.product((TTLinear, TTMLinear), shapes, ranks))
    with tqdm(total=len(cases) * len(batches), desc="layers x batches", leave=False) as bar:
        for cls, (fan_in, fan_out), rank in cases:
            dense = nn.Linear(fan_in, fan_out)
            layer = cls(fan_in, fan_out, ranks=rank)
            layer.autotune = True
            for batch in batches:
                bar.set_postfix_str(f"{cls.__name__} {fan_in}x{fan_out} r{rank} b{batch}")
                plan_times.append(planning_ms(layer, batch))
                x = torch.randn(batch, fan_in)
                t_plan = median_seconds(forward_backward(layer, (x,)), repeats)
                fixed = forward_backward(layer, (x,), layer.forward_fixed_order)
                t_fixed = median_seconds(fixed, repeats)
                t_dense = median_seconds(forward_backward(dense, (x,)), repeats)
                worst = max(worst, t_plan / t_fixed)
                order = layer.plan_for(batch, x.dtype, "cpu").order_expression()
                rows.append([
                    cls.__name__, f"{fan_in}x{fan_out}", rank, batch,
                    f"{t_plan * 1e3:.3f}", f"{t_fixed * 1e3:.3f}", f"{t_dense * 1e3:.3f}",
                    f"{t_plan / t_fixed:.2f}", f"{t_dense / t_plan:.2f}x", order,
                ])
                bar.update()
    print("forward + backward, median ms\n")
    print(table(rows, [
        "layer", "shape", "rank", "rows", "planned", "fixed", "nn.Linear", "planned/fixed",
        "vs dense", "planned order",
    ]))
    print(f"\nworst planned/fixed ratio: {worst:.2f} (target <= 1.10)")
    print(f"uncached planning: median {statistics.median(plan_times):.2f} ms, "
          f"max {max(plan_times):.2f} ms per layer (target < 10 ms)")
    print(f"memory cache hit: {cache_hit_us():.2f} us per get_plan call (target < 50 us)")


if __name__ == "__main__":
    main()
