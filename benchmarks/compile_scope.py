"""First compile of the whole model against its repeated blocks, from an empty cache.

For each model, ``optimize(budget=0.05)`` then the model compiled two ways
(``CompileOptions(blocks=False)``: one graph for the whole model; ``blocks=True``: the
repeated blocks, one graph for blocks of equal shapes, the rest eager;
``comera_compile.compile.policy.blocks``). Each way runs in a process of its own with empty
inductor and plan caches, so each first compile is a real cold start (the C++ precompiled
header, built once per machine, is built before the first). It prints, per model and way:

- the first compiled forward and backward's time (what a user waits for once per run);
- the graphs the backend compiled for it;
- eager, whole and blocks training steps, alternating in one process (medians);
- the largest difference of outputs and gradients against eager, through a random
  projection of the output;
- how many blocks, of how many shapes, and which form ``optimize``'s default compiles.

Models: Hugging Face LLaMA at 4 and 12 layers (and at 12 with ``use_cache=False``) and
GPT-2 from configs, torch's
``nn.TransformerEncoder`` without dropout and the pre-norm SDPA encoder of
``benchmarks/compiled.py``, batch 8 x 128, AdamW. Results go to
``benchmarks/results/compile_scope.md``.

    python benchmarks/compile_scope.py
    python benchmarks/compile_scope.py --models llama --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_results  # noqa: E402
from compiled import MODELS, gradient_difference, output, step  # noqa: E402

import comera_compile as cc  # noqa: E402
from comera_compile.compile.backend import graphs_compiled  # noqa: E402
from comera_compile.compile.policy.blocks import blocks_pay, distinct_shapes, repeated_blocks  # noqa: E402
from comera_compile.tables import text_table  # noqa: E402

SCOPES = ("whole", "blocks")


def build(name: str) -> tuple[torch.nn.Module, torch.Tensor]:
    """The dense model and an input batch (8 x 128). ``llama-12``: LLaMA with 12 layers;
    ``-nocache``: with ``use_cache=False`` (in training, Hugging Face decoders otherwise
    build a key-value cache whose per-layer state each block's graph is guarded on);
    ``-dropout``: dropout 0.1 in every ``nn.Dropout`` and attention."""
    parts = name.split("-")
    base = "sdpa-encoder" if name == "sdpa-encoder" else parts[0]
    builder, width = MODELS[base]
    torch.manual_seed(0)
    dense = builder()
    layers = next((int(p) for p in parts if p.isdigit()), None)
    if layers or "nocache" in parts:
        config = dense.config
        config.num_hidden_layers = layers or config.num_hidden_layers
        config.use_cache = "nocache" not in parts
        torch.manual_seed(0)
        dense = type(dense)(config)
    if "dropout" in parts:  # dropout 0.1 wherever the model has dropout
        for module in dense.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.1
            elif isinstance(module, torch.nn.MultiheadAttention):
                module.dropout = 0.1
    x = torch.randint(0, 256, (8, 128)) if width is None else torch.randn(8, 128, width)
    return dense.train(), x


def compiled_copy(dense, eager, x, scope: str, off: tuple[str, ...] = ()):
    """``optimize``'s result compiled at once (``compile="always"``) in ``scope``, with
    ``eager``'s weights (the ``CompileOptions`` switches named in ``off`` turned off)."""
    blocks = {"blocks": True, "whole": False}.get(scope)  # else optimize's default
    options = cc.CompileOptions(blocks=blocks, **dict.fromkeys(off, False))
    config = cc.CompressionConfig(budget=0.05, compile="always", compile_options=options)
    model = cc.optimize(dense, config, example_inputs=(x,))
    model.load_state_dict(eager.state_dict())
    return model


def measure(name: str, scope: str, steps: int, off: tuple[str, ...] = ()) -> dict:
    """In this (fresh) process: the model compiled in ``scope``, its first forward and
    backward timed, outputs and gradients against eager. For ``blocks`` then the whole
    model is compiled too, and eager, whole and blocks steps alternate (medians)."""
    dense, x = build(name)
    eager = cc.optimize(dense, budget=0.05, example_inputs=(x,), compile=False)
    model = compiled_copy(dense, eager, x, scope, off)
    width = output(eager, x).shape[-1]
    proj = torch.randn(width, generator=torch.Generator().manual_seed(1)) / width**0.5
    out_e = output(eager, x)
    (out_e @ proj).square().mean().backward()
    before = graphs_compiled()
    start = time.perf_counter()
    out_c = output(model, x)
    (out_c @ proj).square().mean().backward()
    compile_s = time.perf_counter() - start
    found = repeated_blocks(eager)
    result = {"compile_s": compile_s, "graphs": graphs_compiled() - before,
              "out_diff": float((out_e - out_c).detach().abs().max() / out_e.detach().abs().max()),
              "grad_diff": gradient_difference(eager, model), "blocks": len(found),
              "shapes": distinct_shapes(found) if found else 0,
              "default": "blocks" if blocks_pay(found) else "whole",
              "form": _form(model)}
    if scope == "whole" or steps == 0:
        return result
    forms = {"eager": eager, "whole": compiled_copy(dense, eager, x, "whole"), "blocks": model}
    opts = {label: torch.optim.AdamW(m.parameters(), lr=1e-4) for label, m in forms.items()}
    for label, m in forms.items():
        opts[label].zero_grad(set_to_none=True)
        for _ in range(2):  # warm-up: the whole model compiles here
            step(m, opts[label], x, proj)
    times = {label: [] for label in forms}
    for _ in range(steps):  # alternate, so drift hits all three
        for label, m in forms.items():
            start = time.perf_counter()
            step(m, opts[label], x, proj)
            times[label].append(time.perf_counter() - start)
    result.update({f"{label}_ms": statistics.median(t) * 1e3 for label, t in times.items()})
    return result


def _form(model: torch.nn.Module) -> str:
    """What a compiled model runs compiled: its blocks (how many of how many) or whole."""
    compiled = getattr(model._compiled_call_impl, "compiled_blocks", None)
    if compiled is None:
        return "whole"
    return f"{len(compiled)}/{len(repeated_blocks(model))} blocks"


def run_cold(name: str, scope: str, steps: int, off: tuple[str, ...] = ()) -> dict:
    """``measure`` in a child process with empty inductor and plan caches (the
    ``CompileOptions`` switches named in ``off`` turned off)."""
    with tempfile.TemporaryDirectory() as inductor, tempfile.TemporaryDirectory() as plans:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor, COMERA_CACHE_DIR=plans)
        done = subprocess.run(
            [sys.executable, __file__, "--child", name, scope, "--steps", str(steps),
             "--off", ",".join(off)],
            env=env, capture_output=True, text=True, check=False)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode or not lines:
        raise RuntimeError(f"{name} ({scope}) failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def build_header() -> None:
    """Compile one small function, so the C++ precompiled header exists before any row."""
    torch.compile(lambda t: torch.nn.functional.gelu(t) + 1)(torch.randn(8, 8))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="llama,llama-12,llama-12-nocache,gpt2,encoder,sdpa-encoder")
    p.add_argument("--steps", type=int, default=5, help="alternating steps per form")
    p.add_argument("--results-name", default="compile_scope")
    p.add_argument("--child", nargs=2, metavar=("MODEL", "SCOPE"), help=argparse.SUPPRESS)
    p.add_argument("--off", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    if args.child:
        off = tuple(name for name in args.off.split(",") if name)
        print(json.dumps(measure(*args.child, args.steps, off)))
        return
    build_header()
    header = ["model", "blocks", "shapes", "default", "whole compile s", "blocks compile s",
              "whole / blocks", "graphs", "eager ms", "whole ms", "blocks ms",
              "whole / eager", "blocks / eager", "out diff", "grad diff"]
    rows = []
    for name in args.models.split(","):
        whole, blocks = (run_cold(name, scope, args.steps) for scope in SCOPES)
        rows.append([
            name, blocks["blocks"], blocks["shapes"], blocks["default"],
            f"{whole['compile_s']:.1f}", f"{blocks['compile_s']:.1f}",
            f"{whole['compile_s'] / blocks['compile_s']:.2f}x",
            f"{whole['graphs']}, {blocks['graphs']}", f"{blocks['eager_ms']:.0f}",
            f"{blocks['whole_ms']:.0f}", f"{blocks['blocks_ms']:.0f}",
            f"{blocks['eager_ms'] / blocks['whole_ms']:.2f}x",
            f"{blocks['eager_ms'] / blocks['blocks_ms']:.2f}x",
            f"{max(whole['out_diff'], blocks['out_diff']):.1e}",
            f"{max(whole['grad_diff'], blocks['grad_diff']):.1e}"])
        print(text_table(header, rows[-1:]), flush=True)
    table = text_table(header, rows, right=range(1, 15))
    body = (f"optimize(budget=0.05) models at batch 8 x 128, AdamW, on cpu with "
            f"{torch.get_num_threads()} CPU threads. 'blocks': the members of the model's "
            "stack of repeated blocks, of 'shapes' distinct sets of parameter shapes; "
            "'default': what optimize compiles (blocks where each graph serves three "
            "blocks or more). Each first compile (forward and backward) ran in a fresh process "
            "with empty inductor and plan caches; 'graphs': the graphs each compiled. The "
            "steps ran in the blocks' process, eager, whole and blocks alternating "
            "(medians). Differences (the larger of the two forms) are relative to eager, "
            "before any optimizer step.\n\n"
            f"```\n{table}\n```\n")
    path = write_results(args.results_name, "First compile: whole model or its blocks", body)
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
