"""First compile with a graph's CPU kernels pooled into one compiler run per worker, against
inductor's one run per kernel (``comera_compile.compile.pooled_kernels``).

For each model, ``optimize(budget=0.05)`` compiled at once in the form ``optimize``'s
default picks (its repeated blocks, or the whole model), the first training forward and
backward timed in a fresh process with empty inductor and plan caches, once with pooling
(the default) and once with ``COMERA_POOLED_KERNELS=0``, the two alternating per model. It
prints both times, their ratio, the graphs compiled and the outputs' and gradients'
differences against eager (the larger of the two runs). Models are those of
``benchmarks/compile_scope.py``. Results go to ``benchmarks/results/pooled_kernels.md``.

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
    p.add_argument("--models", default="llama-nocache,llama,gpt2,encoder,sdpa-encoder")
    p.add_argument("--results-name", default="pooled_kernels")
    args = p.parse_args()
    build_header()
    header = ["model", "form", "graphs", "one run per kernel s", "pooled s", "ratio",
              "out diff", "grad diff"]
    rows = []
    for name in args.models.split(","):
        alone = run_cold(name, "default", 0, COMERA_POOLED_KERNELS="0")
        pooled = run_cold(name, "default", 0)
        rows.append([name, pooled["form"], pooled["graphs"], f"{alone['compile_s']:.1f}",
                     f"{pooled['compile_s']:.1f}",
                     f"{alone['compile_s'] / pooled['compile_s']:.2f}x",
                     f"{max(alone['out_diff'], pooled['out_diff']):.1e}",
                     f"{max(alone['grad_diff'], pooled['grad_diff']):.1e}"])
        print(text_table(header, rows[-1:]), flush=True)
    table = text_table(header, rows, right=range(2, 8))
    body = (f"optimize(budget=0.05) models at batch 8 x 128, AdamW, on cpu with "
            f"{torch.get_num_threads()} CPU threads, compiled in the form optimize's default "
            "picks ('form'). Each time is a first training forward and backward in a fresh "
            "process with empty inductor and plan caches (the C++ precompiled header built "
            "before the first row): inductor's one compiler run per CPU kernel, then the "
            "kernels of each generated module pooled into one run per compile worker. "
            "Differences are relative to eager, before any optimizer step.\n\n"
            f"```\n{table}\n```\n")
    path = write_results(args.results_name, "First compile: pooled CPU kernels", body)
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
