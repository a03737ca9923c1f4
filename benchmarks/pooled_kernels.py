"""First compile with the backend's two changes to inductor's CPU compile, against inductor
as it is: a graph's CPU kernels pooled into one compiler run per worker instead of one per
kernel (``comera_compile.compile.cpu.pooled_kernels``), and the dtype rule table built once
instead of once per generated op (``comera_compile.compile.cpu.dtype_rules``).

For each model, ``optimize(budget=0.05)`` compiled at once in the form ``optimize``'s
default picks (its repeated blocks, or the whole model), the first training forward and
backward timed in a fresh process with empty inductor and plan caches, three ways in turn:
both changes off (``CompileOptions(pooled_kernels=False, dtype_rules_once=False)``),
pooling alone,
and both (the default). It prints the times, the ratio of inductor as it is over the
default, the graphs compiled and the outputs' and gradients' differences against eager (the
largest of the runs). Models are those of ``benchmarks/compile_scope.py``. Results go to
``benchmarks/results/pooled_kernels.md``.

    python benchmarks/pooled_kernels.py
    python benchmarks/pooled_kernels.py --models llama,encoder
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_results  # noqa: E402
from compile_scope import build_header, run_cold  # noqa: E402

from comera_compile.tables import text_table  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="llama,gpt2,encoder,sdpa-encoder")
    p.add_argument("--results-name", default="pooled_kernels")
    args = p.parse_args()
    build_header()
    header = ["model", "form", "graphs", "inductor as is s", "pooled s", "pooled + rules once s",
              "ratio", "out diff", "grad diff"]
    rows = []
    for name in args.models.split(","):
        runs = [run_cold(name, "default", 0, off=("pooled_kernels", "dtype_rules_once")),
                run_cold(name, "default", 0, off=("dtype_rules_once",)),
                run_cold(name, "default", 0)]
        times = [r["compile_s"] for r in runs]
        rows.append([name, runs[-1]["form"], runs[-1]["graphs"], *(f"{t:.1f}" for t in times),
                     f"{times[0] / times[-1]:.2f}x",
                     f"{max(r['out_diff'] for r in runs):.1e}",
                     f"{max(r['grad_diff'] for r in runs):.1e}"])
        print(text_table(header, rows[-1:]), flush=True)
    table = text_table(header, rows, right=range(2, 9))
    body = (f"optimize(budget=0.05) models at batch 8 x 128, AdamW, on cpu with "
            f"{torch.get_num_threads()} CPU threads, compiled in the form optimize's default "
            "picks ('form'). Each time is a first training forward and backward in a fresh "
            "process with empty inductor and plan caches (the C++ precompiled header built "
            "before the first row): inductor as it is (one compiler run per CPU kernel, the "
            "dtype rules rebuilt per generated op), the kernels of each generated module "
            "pooled into one run per compile worker, and pooled with the rules built once "
            "(the default); 'ratio': inductor as is over the default. "
            "Differences are relative to eager, before any optimizer step.\n\n"
            f"```\n{table}\n```\n")
    path = write_results(args.results_name, "First compile: pooled kernels, dtype rules once",
                         body)
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
