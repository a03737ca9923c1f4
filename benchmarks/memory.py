"""Peak training memory and step time of a compressed model against the dense baselines.

Each row trains in a process of its own (``--row``), so one row's freed memory never lowers
another's peak. A row's **training memory** is the peak resident set size (``VmHWM``) over its
timed training steps minus the resident size before its model was built (every module the
rows import already loaded): parameters, gradients, optimizer state and what the steps keep
for backward. The peak is reset (``/proc/self/clear_refs``) after the warm-up steps, so
neither the copy that ``optimize`` makes of the dense model nor a first step's planning and
compiling is counted; what they leave resident is. **kept** is what one step saves for
backward (``torch.autograd.graph.saved_tensors_hooks``, each storage once): torch's own
count of the activation memory. The **step** is the median time of the timed steps (forward,
loss, backward, AdamW), after warm-up. A checkpoint holds its blocks' inputs and the outputs
its policy keeps itself, not through those hooks: **kept** leaves them out of the
checkpointed rows. The rows run in interleaved rounds (``--rounds``, 3 by default) and each
number is the median over the rounds (of two, their mean, which one slow round moves): a 2-core
machine's speed can drift by tens of percent
between one row's process and the next.

Rows: the dense model; the dense model with Hugging Face gradient checkpointing
(``gradient_checkpointing_enable()``); the default (``optimize(model, budget=...,
example_inputs=..., compile=False)``, whose ``recompute="auto"`` decides on the batch); the
compressed model keeping what autograd keeps (``recompute=None``) and with bond recomputation
(``recompute="bonds"``) eager and compiled; ``format="btt"`` at the same budget (the format
that won the pretraining frontier, ``benchmarks/frontier.py``); GaLore (``galore-torch``,
rank 128, on every 2-d weight but the embedding) where installed; and at the small shape the
dense model of the compressed one's parameter count (half the width). Every row calls
``model(input_ids, labels=labels).loss``, random tokens: Hugging Face's loss for the dense
rows, the same value from the lean loss ``optimize`` gives a causal LM for the compressed
ones (``training.causal_loss``).

    flock /tmp/comera-bench.lock python benchmarks/memory.py          # every shape, every row
    python benchmarks/memory.py --shapes small --rows dense,bonds     # a part
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch

import comera_compile as cc

SHAPES = {  # name: (hidden, ffn, layers, heads, vocab, seq, batches)
    "60m": (512, 1376, 8, 8, 32000, 256, (1, 4, 16)),
    "small": (384, 1024, 4, 6, 256, 128, (16,)),
}
ROWS = ("dense", "dense-hf-ckpt", "default", "saved", "bonds", "bonds-compiled", "btt",
        "galore", "dense-equal")
ROW_NAMES = {
    "dense": "dense",
    "dense-hf-ckpt": "dense + HF gradient checkpointing",
    "default": "default (every default but compile=False)",
    "saved": "compressed, recompute=None",
    "bonds": "compressed, recompute='bonds', eager",
    "bonds-compiled": "compressed, recompute='bonds', compiled",
    "btt": "format='btt' (every other default but compile=False)",
    "galore": "dense + GaLore (rank 128)",
    "dense-equal": "dense, equal parameters (half width)",
}


def llama(hidden: int, ffn: int, layers: int, heads: int, vocab: int, seq: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=seq,
        tie_word_embeddings=False, attn_implementation="sdpa", use_cache=False))


def rss_mb(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def release() -> None:
    """Return freed heap memory to the system, so the baseline is what is really held."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def build(args, row: str):
    hidden, ffn, layers, heads, vocab, seq, _ = SHAPES[args.shape]
    torch.manual_seed(0)
    if row == "dense-equal":
        return llama(hidden // 2, ffn // 2, layers, heads // 2, vocab, seq)
    model = llama(hidden, ffn, layers, heads, vocab, seq)
    if row == "dense-hf-ckpt":
        model.gradient_checkpointing_enable()
    if row in ("dense", "dense-hf-ckpt", "galore"):
        return model
    example = (torch.zeros(args.batch, seq, dtype=torch.long),)
    if row in ("default", "btt"):  # recompute="auto" decides on the example batch
        return cc.optimize(model, budget=args.budget, compile=False, example_inputs=example,
                           format="btt" if row == "btt" else None)
    config = cc.CompressionConfig(
        budget=args.budget, compile="always" if row == "bonds-compiled" else False,
        recompute=None if row == "saved" else "bonds")
    return cc.optimize(model, config, example_inputs=example)


def optimizer_for(row: str, model):
    if row == "galore":
        from galore_torch import GaLoreAdamW

        big = [p for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n]
        ids = {id(p) for p in big}
        rest = [p for p in model.parameters() if id(p) not in ids]
        return GaLoreAdamW([{"params": rest}, {"params": big, "rank": 128, "update_proj_gap": 200,
                                               "scale": 0.25, "proj_type": "std"}], lr=1e-3)
    if cc.nn.tensorized_layers(model):
        return torch.optim.AdamW(cc.training.param_groups(model, lr=1e-3))
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def kept_mb(step) -> float:
    """MB saved for backward by one step, each storage counted once."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.layout == torch.strided and t.device.type != "meta":
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(seen.values()) / 2**20


def run_row(args) -> dict:
    torch.set_num_threads(args.threads)
    *_, vocab, seq, _ = SHAPES[args.shape]
    import transformers.models.llama.modeling_llama  # noqa: F401

    import comera_compile.compile  # noqa: F401  code every row may load: before the baseline

    release()
    before = rss_mb()
    model = build(args, args.row)
    model.train()
    optimizer = optimizer_for(args.row, model)
    params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (args.batch, seq), generator=gen)

    def step() -> None:
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(args.warmup):  # makes the optimizer state and the plans, compiles
        step()
    release()
    with open("/proc/self/clear_refs", "w") as f:  # the peak of the steps from here on
        f.write("5")
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    peak = rss_mb("VmHWM")
    return {"row": args.row, "params": params, "train_mb": peak - before,
            "kept_mb": kept_mb(step), "step_s": statistics.median(times)}


def rows_for(shape: str, rows: list[str]) -> list[str]:
    out = [r for r in rows if r != "dense-equal" or shape == "small"]
    if "galore" in out:
        try:
            import galore_torch  # noqa: F401
        except ImportError:
            out.remove("galore")
    return out


def run_all(args) -> str:
    from _results import write_results  # benchmarks/: run as a script

    sections = []
    for shape in args.shapes.split(","):
        hidden, ffn, layers, heads, vocab, seq, batches = SHAPES[shape]
        for batch in batches:
            runs: dict[str, list[dict]] = {}
            rows = rows_for(shape, args.rows.split(","))
            for _ in range(args.rounds):  # rounds interleave the rows: drift hits them alike
                for row in rows:
                    command = [sys.executable, __file__, "--row", row, "--shape", shape,
                               "--batch", str(batch), "--budget", str(args.budget),
                               "--steps", str(args.steps), "--warmup", str(args.warmup),
                               "--threads", str(args.threads)]
                    done = subprocess.run(command, capture_output=True, text=True)
                    if done.returncode:
                        print(done.stderr[-3000:], file=sys.stderr)
                        continue
                    result = json.loads(done.stdout.strip().splitlines()[-1])
                    runs.setdefault(row, []).append(result)
                    print(shape, batch, json.dumps(runs[row][-1]), flush=True)
            results = {row: _median_run(runs[row]) if row in runs else None for row in rows}
            sections.append(section(shape, batch, results))
    body = (f"LLaMA shapes (`transformers.LlamaForCausalLM`, random tokens, Hugging Face's loss, "
            f"AdamW), compressed rows at budget {args.budget}; {args.warmup} warm-up and "
            f"{args.steps} timed steps per row, one process per row and round, "
            f"{args.rounds} rounds through the rows (each number the median over them), "
            f"{args.threads} threads. Memory: peak RSS over the steps minus RSS before the "
            "model was built; kept: bytes one step saves through autograd's saved-tensor hooks "
            "(what a checkpoint holds itself, its blocks' inputs and cached bonds, is not in "
            "it).\n\n"
            + "\n\n".join(sections))
    path = write_results("memory", "Training memory and step time", body)
    print(body)
    print(f"wrote {path}")
    return body


def _median_run(runs: list[dict]) -> dict:
    """One row's rounds as one: the median of their memory and of their step times."""
    out = dict(runs[0])
    for key in ("train_mb", "kept_mb", "step_s"):
        out[key] = statistics.median(r[key] for r in runs)
    return out


def section(shape: str, batch: int, results: dict) -> str:
    hidden, ffn, layers, heads, vocab, seq, _ = SHAPES[shape]
    dense = results.get("dense")
    lines = [f"**{shape}** (hidden {hidden}, FFN {ffn}, {layers} layers, {heads} heads, "
             f"vocabulary {vocab}), batch {batch} x {seq}:", "",
             "| row | parameters | training MB | vs dense | kept MB | step s | vs dense |",
             "|---|---|---|---|---|---|---|"]
    for row, r in results.items():
        if r is None:
            lines.append(f"| {ROW_NAMES[row]} | failed | | | | | |")
            continue
        mem = f"{r['train_mb'] / dense['train_mb']:.2f}x" if dense else ""
        step = f"{r['step_s'] / dense['step_s']:.2f}x" if dense else ""
        lines.append(f"| {ROW_NAMES[row]} | {r['params']:,} | {r['train_mb']:,.0f} | {mem} | "
                     f"{r['kept_mb']:,.0f} | {r['step_s']:.3f} | {step} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="60m,small")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3,
                        help="times through every row, interleaved (medians are reported)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--row", choices=ROWS, help=argparse.SUPPRESS)
    parser.add_argument("--shape", choices=tuple(SHAPES), help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.row:
        print(json.dumps(run_row(args)))
    else:
        run_all(args)


if __name__ == "__main__":
    main()
