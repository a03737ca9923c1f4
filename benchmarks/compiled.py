"""Compiled against eager training steps on models we did not write, side by side.

For each model: ``optimize`` with its defaults (compiled, with the first training steps
raced against eager, the faster kept) next to the same compressed model eager
(``compile=False``), same weights, in one process. It prints, per model:

- the forced compiled step over eager (the race's own medians, compiled with inductor),
  beside the most it could be on CPU (one eager step, profiled: ``compile.policy.step_bound``);
- what the default kept, and its steady step over eager's (alternating steps, medians):
  never below 1.0x is the point of the default (a run of unknown length first runs eager
  for ``WAIT_S``; this benchmark skips that wait and races at once);
- the first compiled forward and backward's time (a first compile: each model gets an
  empty inductor cache unless ``--warm-cache``);
- the largest difference of outputs and of gradients against eager, through a random
  projection of the output (not a ``.sum()`` after a LayerNorm, whose gradient is zero).

Models: torch's ``nn.TransformerEncoder`` without dropout (2 x 768, 12 heads, FFN 3072),
a pre-norm SDPA encoder written here without dropout (4 x 512, 8 heads), and Hugging
Face's LLaMA (rotary, grouped-query heads, SwiGLU) and GPT-2 (fused QKV ``c_attn``) from
configs, all at batch 8 x 128, AdamW. Results go to ``benchmarks/results/compiled.md``.

``--models shapes`` runs other shapes instead, so that no gain rests on one model's: torch's
encoder sequence-first (4 x 256, 4 heads), pre-norm with GELU (3 x 512, 8 heads) and with
heads 32 wide (2 x 384, 12 heads), and a causal block with one fused Q/K/V layer chunked in
three (3 x 384, 6 heads); ``--budget none`` takes ``optimize``'s own default.

    python benchmarks/compiled.py                      # every model
    python benchmarks/compiled.py --models encoder,llama --steps 6
    python benchmarks/compiled.py --models shapes --budget none --results-name compiled_shapes
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch._inductor.utils import fresh_cache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_results  # noqa: E402

import comera_compile as cc  # noqa: E402
from comera_compile.compile.graph.absorbed_attention import attentions_absorbed  # noqa: E402
from comera_compile.compile.policy.measured import COMPILED  # noqa: E402
from comera_compile.compile.policy.step_bound import StepProfile  # noqa: E402
from comera_compile.tables import text_table  # noqa: E402


class SdpaBlock(nn.Module):
    """A pre-norm encoder block with ``F.scaled_dot_product_attention`` and no dropout."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, w = x.shape
        h = self.norm1(x)
        split = lambda y: y.view(b, t, self.heads, w // self.heads).transpose(1, 2)  # noqa: E731
        a = F.scaled_dot_product_attention(split(self.q(h)), split(self.k(h)), split(self.v(h)))
        x = x + self.o(a.transpose(1, 2).reshape(b, t, w))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


def sdpa_encoder(width: int = 512, heads: int = 8, layers: int = 4) -> nn.Module:
    return nn.Sequential(*(SdpaBlock(width, heads) for _ in range(layers)))


class CausalFusedBlock(nn.Module):
    """A pre-norm causal block whose Q, K and V come from one layer, chunked (nanoGPT's
    layout), without biases on it, ReLU in the FFN."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.o = nn.Linear(width, 3 * width, bias=False), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        split = lambda y: y.view(b, t, self.heads, w // self.heads).transpose(1, 2)  # noqa: E731
        a = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, w))
        return x + self.down(F.relu(self.up(self.norm2(x))))


def torch_encoder(width: int = 768, heads: int = 12, layers: int = 2, batch_first: bool = True,
                  **options) -> nn.Module:
    layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0,
                                       batch_first=batch_first, **options)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


def hf_model(kind: str) -> nn.Module:
    import transformers as tf

    if kind == "llama":
        config = tf.LlamaConfig(vocab_size=256, hidden_size=384, intermediate_size=1024,
                                num_hidden_layers=4, num_attention_heads=6,
                                num_key_value_heads=2, max_position_embeddings=128,
                                attn_implementation="sdpa")
        return tf.LlamaForCausalLM(config)
    config = tf.GPT2Config(vocab_size=256, n_embd=384, n_layer=4, n_head=6, n_positions=128,
                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                           attn_implementation="sdpa")
    return tf.GPT2LMHeadModel(config)


MODELS = {  # name: (builder, input width; None: byte tokens)
    "encoder": (torch_encoder, 768),
    "sdpa-encoder": (sdpa_encoder, 512),
    "llama": (lambda: hf_model("llama"), None),
    "gpt2": (lambda: hf_model("gpt2"), None),
}
SHAPES = {  # other shapes and layouts (--models shapes)
    "encoder-seq-first": (lambda: torch_encoder(256, 4, 4, batch_first=False), 256),
    "encoder-pre-norm-gelu": (
        lambda: torch_encoder(512, 8, 3, norm_first=True, activation="gelu"), 512),
    "encoder-heads-32": (lambda: torch_encoder(384, 12, 2), 384),
    "causal-fused-qkv": (lambda: nn.Sequential(*(CausalFusedBlock(384, 6) for _ in range(3))),
                         384),
}
SEQUENCE_FIRST = {"encoder-seq-first"}  # inputs (sequence, batch, width)


def output(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out.logits if hasattr(out, "logits") else out


def step(model, opt, x, proj) -> None:
    loss = (output(model, x) @ proj).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if x.is_cuda:
        torch.cuda.synchronize()  # time the finished step, not its launch


def gradient_difference(a: nn.Module, b: nn.Module) -> float:
    """The largest ``|g_a - g_b| / |g_a|`` over parameters (norms), leaving out those whose
    gradient is rounding noise (under 1e-6 of the largest; e.g. an attention key bias,
    which softmax cancels: exactly zero compiled, noise eager)."""
    pairs = [(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters())
             if p.grad is not None and q.grad is not None]
    scale = max(float(g.norm()) for g, _ in pairs)
    return max(float((g - h).norm() / g.norm()) for g, h in pairs if g.norm() > 1e-6 * scale)


def measure(name: str, args) -> dict:
    build, width = {**MODELS, **SHAPES}[name]
    torch.manual_seed(0)
    dense = build().train().to(args.device)
    if width is None:
        x = torch.randint(0, 256, (args.batch, args.seq))
    elif name in SEQUENCE_FIRST:
        x = torch.randn(args.seq, args.batch, width)
    else:
        x = torch.randn(args.batch, args.seq, width)
    x = x.to(args.device)
    fmt = {"format": args.format} if args.format else {}
    eager = cc.optimize(dense, budget=args.budget, example_inputs=(x,), compile=False, **fmt)
    default = cc.optimize(dense, budget=args.budget, example_inputs=(x,), **fmt)
    default.load_state_dict(eager.state_dict())
    width = output(eager, x).shape[-1]
    proj = torch.randn(width, generator=torch.Generator().manual_seed(1)) / width**0.5
    proj = proj.to(args.device)
    # equality first, before any optimizer step: outputs and gradients, compiled vs eager
    compiled_call = default._compiled_call_impl.compiled_form
    absorbed_before = attentions_absorbed()
    out_e = output(eager, x)
    start = time.perf_counter()  # the first compiled call compiles its forward and backward
    out_c = compiled_call(x)
    out_c = out_c.logits if hasattr(out_c, "logits") else out_c
    (out_c @ proj).square().mean().backward()
    compile_s = time.perf_counter() - start
    absorbed = attentions_absorbed() - absorbed_before
    out_diff = float((out_e - out_c).detach().abs().max() / out_e.detach().abs().max())
    (out_e @ proj).square().mean().backward()
    grad_diff = gradient_difference(eager, default)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-4)
    opt_d = torch.optim.AdamW(default.parameters(), lr=1e-4)
    opt_e.zero_grad(set_to_none=True)
    opt_d.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    impl = default._compiled_call_impl
    impl.wait_s = 0.0  # the race itself, at once: a run this long would wait first (WAIT_S)
    race = impl.races["training"]
    while race.choice is None:  # the default's own race: compile, then time both forms
        step(default, opt_d, x, proj)
    race_s = time.perf_counter() - t0
    step(eager, opt_e, x, proj)  # eager's warm-up
    bound = eager_bound(eager, opt_e, x, proj) if not x.is_cuda else None
    times = {"eager": [], "default": []}
    for _ in range(args.steps):  # alternate, so drift hits both
        for label, model, opt in (("eager", eager, opt_e), ("default", default, opt_d)):
            start = time.perf_counter()
            step(model, opt, x, proj)
            times[label].append(time.perf_counter() - start)
    eager_s, default_s = (statistics.median(times[k]) for k in ("eager", "default"))
    return {
        "model": name,
        "compiled_over_eager": race.speedup,
        "bound": bound,
        "kept": race.choice,
        "eager_ms": eager_s * 1e3,
        "default_ms": default_s * 1e3,
        "default_over_eager": eager_s / default_s,
        "race_s": race_s,
        "compile_s": compile_s,
        "absorbed": absorbed,
        "out_diff": out_diff,
        "grad_diff": grad_diff,
    }


def eager_bound(model, opt, x, proj) -> float:
    """The most a compiled step could gain on CPU: one eager step, profiled as the default
    compile profiles one (``compile.policy.step_bound.StepProfile``)."""
    profile = StepProfile()
    step(model, opt, x, proj)
    return profile.bound(time.perf_counter() - profile.start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--budget", type=lambda v: None if v == "none" else float(v), default=0.05,
                   help="optimize's budget, or 'none' for its default")
    p.add_argument("--steps", type=int, default=5, help="alternating steady steps per form")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cpu or cuda (CUDA Graphs on by default)")
    p.add_argument("--format", default=None, help="layer format (default: optimize's)")
    p.add_argument("--warm-cache", action="store_true",
                   help="use inductor's cache as it is (default: an empty one per model, so "
                        "'compile s' is a first compile)")
    p.add_argument("--results-name", default="compiled")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    names = list(SHAPES) if args.models == "shapes" else args.models.split(",")
    for name in names:
        with contextlib.ExitStack() as stack:
            if not args.warm_cache:  # compile from scratch, as in a new environment
                stack.enter_context(fresh_cache())
            r = measure(name, args)
        print(r, flush=True)
        rows.append([
            r["model"], f"{r['compiled_over_eager']:.2f}x",
            f"{r['bound']:.2f}x" if r["bound"] is not None else "-", r["kept"],
            f"{r['eager_ms']:.0f}", f"{r['default_ms']:.0f}", f"{r['default_over_eager']:.2f}x",
            f"{r['compile_s']:.0f}", f"{r['race_s']:.0f}", str(r["absorbed"]),
            f"{r['out_diff']:.1e}",
            f"{r['grad_diff']:.1e}",
        ])
    header = ["model", "compiled / eager (race)", "bound", "default kept", "eager ms", "default ms",
              "default / eager", "compile s", "race s", "absorbed", "out diff", "grad diff"]
    text = text_table(header, rows, right=range(1, len(header)))
    print(text)
    fmt = f", format={args.format!r}" if args.format else ""
    body = (f"Training steps at batch {args.batch} x {args.seq}, optimize(budget="
            f"{args.budget}{fmt}), AdamW, on {args.device} with {args.threads} CPU threads; "
            "ratios are eager time over compiled time, measured in one process (the race: "
            f"{COMPILED!r} and eager steps in turn; steady: alternating steps). Differences are "
            "relative, before any optimizer step. 'bound': one eager step, profiled, over its "
            "time in matrix products, attention, activations' arithmetic and the optimizer, "
            "which compiled CPU code runs as eager does (compile.policy.step_bound): the most a "
            "compiled step of the same kernels could gain. 'absorbed': attentions the "
            "compiled graphs compute through their rank bonds (compile.graph.absorbed_attention; "
            "counted per graph compiled, so a graph that repeated blocks share counts "
            "once), whose attention kernels and model-wide Q, K, V they leave out: there a "
            "compiled step can beat the bound. 'compile s': "
            "the first compiled forward and backward, "
            + ("with inductor's cache as found" if args.warm_cache else
               "from an empty inductor cache") + ".\n\n```\n" + text + "\n```\n")
    if not args.no_write:
        print("wrote", write_results(args.results_name, "Compiled against eager", body))


if __name__ == "__main__":
    main()
