"""Peak memory of getting a 1B-parameter-class LLaMA ready to train: built dense, against built
on the meta device and optimized with init="random" (only the cores are ever allocated).

    python benchmarks/meta_init.py            # LLaMA 1.1B shape (TinyLlama), bfloat16
    python benchmarks/meta_init.py --small    # a 4-layer version, for a quick look

Each way runs in its own subprocess, so each peak RSS (``ru_maxrss``) is that way's alone.
Both build in bfloat16: the dense float32 model would need about 4.4 GB, more than a shared
test machine should give one process (bfloat16 halves it; the ratio is what matters).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

CONFIG = dict(  # TinyLlama-1.1B's shape
    vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
    num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
)
BUDGET = 0.05


def run(way: str, layers: int) -> dict:
    """Build the model one way in this process and report what it took."""
    import torch
    import transformers

    import comera_compile as cc

    torch.set_default_dtype(torch.bfloat16)
    config = transformers.LlamaConfig(**{**CONFIG, "num_hidden_layers": layers})
    start = time.perf_counter()
    if way == "dense":
        model = transformers.LlamaForCausalLM(config)
    else:
        with torch.device("meta"):
            dense_shape = transformers.LlamaForCausalLM(config)
        model = cc.optimize(dense_shape, BUDGET, init="random", compile=False)
    seconds = time.perf_counter() - start
    with torch.no_grad():  # the model is real: it runs
        logits = model(torch.randint(0, config.vocab_size, (1, 8))).logits
    assert torch.isfinite(logits).all()
    return {
        "way": way,
        "params": sum(p.numel() for p in model.parameters()),
        "bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "seconds": seconds,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="4 layers instead of 22")
    parser.add_argument("--child", choices=["dense", "meta"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    layers = 4 if args.small else CONFIG["num_hidden_layers"]
    if args.child:
        print(json.dumps(run(args.child, layers)))
        return
    from tqdm import tqdm

    import comera_compile
    from comera_compile.cli.machine import describe_machine

    package_root = str(Path(comera_compile.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": package_root}  # children import the same package

    print(describe_machine())
    results = []
    for way in tqdm(["meta", "dense"], desc="building (one subprocess each)"):
        command = [sys.executable, __file__, "--child", way] + (["--small"] if args.small else [])
        out = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    meta, dense = results
    print(f"LLaMA {layers} layers, hidden {CONFIG['hidden_size']}, vocab "
          f"{CONFIG['vocab_size']}, bfloat16; optimize budget {BUDGET}")
    print(f"{'way':<34}{'parameters':>16}{'param bytes':>14}{'peak RSS':>12}{'build s':>9}")
    for r, label in ((dense, "dense build"), (meta, "meta build + optimize(random)")):
        print(f"{label:<34}{r['params']:>16,}{r['bytes'] / 2**20:>11,.0f} MB"
              f"{r['peak_rss'] / 2**20:>9,.0f} MB{r['seconds']:>9.1f}")
    print(f"peak RSS ratio dense / meta: {dense['peak_rss'] / meta['peak_rss']:.1f}x")


if __name__ == "__main__":
    main()
