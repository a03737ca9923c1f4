"""``comera demo``: optimize a transformer under a budget, train it with CoMERA, compare.

A small six-encoder classifier learns the synthetic sentence-pair task twice from the same
initial weights and data: once dense, once after ``optimize`` with rank-adaptive training
(early stage, then a late stage that drives to a target size). It prints the layer summary,
both accuracies, parameter counts, step times and the plans the layers run, and saves the
rank history (CSV and plot).
"""

from __future__ import annotations

import copy
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from comera_compile.api import Budget, optimize, plans, summary
from comera_compile.models import SixEncoderClassifier, SixEncoderConfig
from comera_compile.models.pair_task import PairTask
from comera_compile.training import RankAdaptiveTrainer, param_groups, plot_ranks


@torch.no_grad()
def accuracy(model: nn.Module, task: PairTask, n: int = 2048, seed: int = 12345) -> float:
    model.eval()
    ids, types, labels = task.batch(n, torch.Generator().manual_seed(seed))
    correct = (model(ids, types).argmax(-1) == labels).float().mean().item()
    model.train()
    return 100.0 * correct


def train(model, optimizer, task, steps, batch, seed, trainer=None, log_every=50, name=""):
    """Train on a fixed stream of batches; returns the per-step times in seconds."""
    generator = torch.Generator().manual_seed(seed)
    times = []
    model.train()
    for step in range(1, steps + 1):
        ids, types, labels = task.batch(batch, generator)
        start = time.perf_counter()
        task_loss = F.cross_entropy(model(ids, types), labels)
        loss = trainer.loss(task_loss) if trainer else task_loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if trainer:
            trainer.step()
        times.append(time.perf_counter() - start)
        if step % log_every == 0 or step == steps:
            extra = ""
            if trainer:
                extra = f"  stage {trainer.stage}  params {trainer.history[-1]['params']:,}"
            print(f"  {name} step {step:4d}  loss {task_loss.item():.3f}{extra}")
    return times


def run_demo(steps: int = 1000, out: str = "runs/demo", seed: int = 0, batch: int = 32) -> dict:
    if steps < 10:
        raise ValueError(
            f"the demo needs at least 10 steps (an early and a late stage), got {steps}"
        )
    torch.manual_seed(seed)
    task = PairTask(vocab_size=8192, sentence_len=8)
    config = SixEncoderConfig(
        vocab_size=task.vocab_size,
        hidden=256,
        ffn=1024,
        heads=4,
        layers=2,
        max_position=task.seq_len,
        dropout=0.0,
    )
    dense = SixEncoderClassifier(config)
    example = task.batch(batch, torch.Generator().manual_seed(seed))[:2]
    model = optimize(dense, Budget(ratio=8), example_inputs=example, compile=False)
    print(summary(model), "\n")

    dense_params = sum(p.numel() for p in dense.parameters())
    reference = copy.deepcopy(dense)
    print(f"dense model: {dense_params:,} parameters, training {steps} steps")
    dense_opt = torch.optim.AdamW(reference.parameters(), lr=3e-4, weight_decay=0.0)
    dense_times = train(reference, dense_opt, task, steps, batch, seed + 1, name="dense ")

    start_params = sum(p.numel() for p in model.parameters())
    print(f"\ncompressed model: {start_params:,} parameters, CoMERA training {steps} steps")
    optimizer = torch.optim.AdamW(param_groups(model, lr_cores=1e-3, lr_gates=6e-3, lr_rest=3e-4))
    early = steps * 2 // 5
    # l2 on the cores stops them from growing to make up for shrinking gates (a channel
    # switched off at the threshold then carries little); task_target is L_t
    trainer = RankAdaptiveTrainer(
        model,
        optimizer,
        target_ratio=0.6,
        early_steps=early,
        prune_every=25,
        l2_weight=1e-4,
        task_target=0.1,
    )
    times = train(model, optimizer, task, steps, batch, seed + 1, trainer, name="comera")

    final_params = sum(p.numel() for p in model.parameters())
    results = {
        "dense_accuracy": accuracy(reference, task),
        "comera_accuracy": accuracy(model, task),
        "dense_params": dense_params,
        "comera_params_start": start_params,
        "comera_params_end": final_params,
        # medians past the first quarter of each phase (plans and allocations warm up there)
        "dense_ms": 1e3 * statistics.median(dense_times[steps // 4 :]),
        "comera_early_ms": 1e3 * statistics.median(times[early // 4 : early]),
        "comera_late_ms": 1e3 * statistics.median(times[-max(1, steps // 10) :]),
    }
    print("\n                       dense      CoMERA")
    dense_acc, comera_acc = results["dense_accuracy"], results["comera_accuracy"]
    print(f"test accuracy (%)   {dense_acc:8.1f}    {comera_acc:8.1f}")
    print(
        f"parameters       {dense_params:11,} {final_params:11,}   "
        f"({dense_params / final_params:.1f}x smaller; {start_params:,} after optimize)"
    )
    print(
        f"step time (ms)      {results['dense_ms']:8.1f}    {results['comera_early_ms']:8.1f}"
        f" early -> {results['comera_late_ms']:.1f} after pruning"
    )
    reached = "reached" if trainer.target_reached else "not reached yet: train longer"
    print(
        f"late stage: size {trainer.size_start:,} -> {trainer.size():,}, target "
        f"{trainer.size_target:,.0f} ({reached})"
    )
    print("\neffective ranks after training:")
    for name, ranks in trainer.history[-1]["ranks"].items():
        print(f"  {name:32s} {ranks}")
    print("\nplans at this batch (rows = batch x tokens) and at one token:")
    report = plans(model, batch_sizes=[1, batch * task.seq_len])
    print(report)

    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    trainer.history.to_csv(directory / "history.csv")
    plot_ranks(trainer.history, directory / "ranks.png")
    report.to_json(directory / "plans.json")
    print(
        f"\nwrote {directory / 'history.csv'}, {directory / 'ranks.png'}, "
        f"{directory / 'plans.json'}"
    )
    return results
