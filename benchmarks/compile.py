"""Training step time of the six-encoder model: dense vs tensorized, eager vs compiled.

One process, four variants measured side by side on the same batch: dense eager, dense +
inductor, comera eager (the CoMERA paper's factorizations) and comera + ``backend="comera"``.
A step is forward + cross-entropy + backward + AdamW step; we report the median over
``--steps`` steps after ``--warmup`` steps (compilation happens in the warm-up).

    python benchmarks/compile.py                      # batch 32 x 128 tokens, hidden 768
    python benchmarks/compile.py --hidden 192 --steps 5   # a quick run
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from comera_compile.cli.six_encoder import (
    SixEncoderClassifier,
    SixEncoderConfig,
    reference_tensorized,
)
from comera_compile.compile import capture_train_step
from comera_compile.nn import TTEmbedding, TTLinear


def tensorized(config: SixEncoderConfig, rank: int) -> SixEncoderClassifier:
    """The CoMERA paper's factorizations at 768/3072; automatic modes at other sizes."""
    if (config.hidden, config.ffn) == (768, 3072):
        return reference_tensorized(config, max_rank=rank)
    model = SixEncoderClassifier(config)

    def swap(module: nn.Module) -> None:
        for name, child in module.named_children():
            if isinstance(child, nn.Linear) and child.out_features > config.num_labels:
                setattr(module, name, TTLinear(child.in_features, child.out_features, ranks=rank))
            else:
                swap(child)

    swap(model)
    model.word_embeddings = TTEmbedding(config.vocab_size, config.hidden, ranks=32)
    return model


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    ids, labels = batch
    return F.cross_entropy(model(ids), labels)


def make_step(model: nn.Module, batch, mode: str) -> Callable[[], torch.Tensor]:
    """``mode``: "eager", "inductor" (torch.compile default backend) or "comera"."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    if mode == "comera":
        step = capture_train_step(model, optimizer, loss_fn, batch)
        return lambda: step(batch)
    forward = loss_fn
    if mode == "inductor":
        forward = torch.compile(loss_fn, backend="inductor", dynamic=False)

    def run() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = forward(model, batch)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return run


def time_steps(step: Callable[[], torch.Tensor], warmup: int, steps: int) -> tuple[float, float]:
    """(seconds of the warm-up, including compilation; median seconds of one step)."""
    start = time.perf_counter()
    for _ in range(warmup):
        step()
    first = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loss = step()
        if loss.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return first, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--rank", type=int, default=30)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch default)")
    parser.add_argument("--only", default="dense-eager,dense-inductor,comera-eager,comera-backend")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    config = SixEncoderConfig(
        vocab_size=32000,
        hidden=args.hidden,
        ffn=4 * args.hidden,
        heads=max(1, args.hidden // 64),
        layers=args.layers,
        max_position=max(512, args.seq),
    )
    g = torch.Generator().manual_seed(0)
    batch = (
        torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=g).to(args.device),
        torch.randint(0, config.num_labels, (args.batch,), generator=g).to(args.device),
    )
    variants = {
        "dense-eager": (lambda: SixEncoderClassifier(config), "eager"),
        "dense-inductor": (lambda: SixEncoderClassifier(config), "inductor"),
        "comera-eager": (lambda: tensorized(config, args.rank), "eager"),
        "comera-backend": (lambda: tensorized(config, args.rank), "comera"),
    }
    wanted = args.only.split(",")
    print(
        f"six-encoder hidden {args.hidden}, {args.layers} layers, batch {args.batch} x "
        f"{args.seq} tokens, {args.device}, {torch.get_num_threads()} threads; median of "
        f"{args.steps} steps after {args.warmup} warm-up steps"
    )
    results: dict[str, tuple[float, float, int]] = {}
    for name in wanted:
        build, mode = variants[name]
        torch.manual_seed(0)
        model = build().to(args.device).train()
        params = sum(p.numel() for p in model.parameters())
        first, median = time_steps(make_step(model, batch, mode), args.warmup, args.steps)
        results[name] = (median, first, params)
        print(f"  {name:15s} {median * 1e3:10.1f} ms/step   (warm-up {first:6.1f} s)", flush=True)
        del model
        torch._dynamo.reset()

    print()
    header = f"{'variant':15s} {'params':>11s} {'ms/step':>10s}"
    refs = [r for r in ("dense-eager", "dense-inductor", "comera-eager") if r in results]
    header += "".join(f" {'vs ' + r:>18s}" for r in refs)
    print(header)
    for name, (median, _, params) in results.items():
        row = f"{name:15s} {params:11,d} {median * 1e3:10.1f}"
        row += "".join(f" {results[r][0] / median:17.2f}x" for r in refs)
        print(row)


if __name__ == "__main__":
    main()
