"""``comera demo``: optimize a transformer under a budget, train it with CoMERA, compare."""

from __future__ import annotations

import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from comera_compile.api import Budget, optimize, plans, summary
from comera_compile.cli.machine import describe_machine, reproducible
from comera_compile.cli.pair_task import PairTask
from comera_compile.cli.six_encoder import SixEncoderClassifier, SixEncoderConfig
from comera_compile.nn import tensorized_layers
from comera_compile.training import RankAdaptiveTrainer, param_groups, plot_ranks


@torch.no_grad()
def accuracy(model: nn.Module, task: PairTask, n: int = 2048, seed: int = 12345) -> float:
    model.eval()
    ids, types, labels = task.batch(n, torch.Generator().manual_seed(seed))
    correct = (model(ids, types).argmax(-1) == labels).float().mean().item()
    model.train()
    return 100.0 * correct


def train(model, optimizer, task, steps, batch, seed, trainer=None, name="", progress=True):
    """Train on a fixed stream of batches; returns the per-step times in seconds."""
    generator = torch.Generator().manual_seed(seed)
    times = []
    model.train()
    bar = tqdm(range(1, steps + 1), desc=name, unit="step", disable=not progress,
               file=sys.stderr, ncols=99, mininterval=1.0)
    for step in bar:
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
        if step % 25 == 0 or step == steps:
            shown = {"loss": f"{task_loss.item():.3f}"}
            if trainer:
                shown |= {"stage": trainer.stage, "params": f"{trainer.size():,}"}
            bar.set_postfix(shown, refresh=False)
    return times


def run_demo(steps: int = 1000, out: str = "runs/demo", seed: int = 0, batch: int = 32,
             threads: int = 1, progress: bool = True) -> dict:
    """Train dense and CoMERA side by side; print the result table last and return it."""
    if steps < 10:
        raise ValueError(
            f"the demo needs at least 10 steps (an early and a late stage), got {steps}"
        )
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)  # fail on a bad folder before training
    with reproducible(seed, threads):
        return _run(steps, directory, seed, batch, progress)


def _run(steps: int, directory: Path, seed: int, batch: int, progress: bool) -> dict:
    print(describe_machine())
    print("comera demo: one small transformer trained twice on the same data, "
          "dense and compressed.")
    task = PairTask(vocab_size=8192, sentence_len=8)
    config = SixEncoderConfig(vocab_size=task.vocab_size, hidden=256, ffn=1024, heads=4, layers=2,
                              max_position=task.seq_len, dropout=0.0)
    dense = SixEncoderClassifier(config)
    dense_params = sum(p.numel() for p in dense.parameters())
    print(f"model: a {config.layers}-layer transformer classifier, hidden {config.hidden}, "
          f"vocabulary {config.vocab_size:,}: {dense_params:,} parameters")
    example = task.batch(batch, torch.Generator().manual_seed(seed))[:2]
    model = optimize(dense, Budget(ratio=8), example_inputs=example, compile=False)
    start_params = sum(p.numel() for p in model.parameters())
    (directory / "summary.txt").write_text(str(summary(model)) + "\n")
    formats = sorted({r["format"] for r in summary(model).records})
    print(f"optimize(model, budget=8x smaller): {len(tensorized_layers(model))} layers now "
          f"compressed ({', '.join(formats)}), {start_params:,} parameters")

    reference = copy.deepcopy(dense)
    print(f"training dense, {steps} steps (batch {batch} pairs of {task.seq_len} tokens)")
    dense_opt = torch.optim.AdamW(reference.parameters(), lr=3e-4, weight_decay=0.0)
    dense_times = train(reference, dense_opt, task, steps, batch, seed + 1, name="dense ",
                        progress=progress)

    early = steps * 2 // 5
    print(f"training CoMERA, {steps} steps: {early} early (rank gates shrink), "
          "then late (prune to 60% of the size)")
    optimizer = torch.optim.AdamW(param_groups(model, lr_cores=1e-3, lr_gates=6e-3, lr_rest=3e-4))
    # l2 on the cores stops them from growing to make up for shrinking gates (a channel
    # switched off at the threshold then carries little). The run's length is known, so the
    # late stage follows a size budget down to the target, cutting the channels that carry
    # least, with the task loss at full weight throughout
    trainer = RankAdaptiveTrainer(model, optimizer, target_ratio=0.6, early_steps=early,
                                  prune_every=25, l2_weight=1e-4, total_steps=steps)
    times = train(model, optimizer, task, steps, batch, seed + 1, trainer, name="CoMERA",
                  progress=progress)

    final_params = sum(p.numel() for p in model.parameters())
    print(target_line(trainer))
    print("effective ranks after training (TT ranks between cores; pruned for real):")
    for name, ranks in trainer.history[-1]["ranks"].items():
        print(f"  {name:28s} {ranks}")

    trainer.history.to_csv(directory / "history.csv")
    plot_ranks(trainer.history, directory / "ranks.png")
    plans(model, batch_sizes=[1, batch * task.seq_len]).to_json(directory / "plans.json")
    print(f"wrote {directory}/: summary.txt (layers), history.csv and ranks.png (ranks over "
          "time), plans.json")

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
    print(result_table(results, batch, task.seq_len))
    return results


def target_line(trainer: RankAdaptiveTrainer) -> str:
    """Where the late stage ended against its target, in numbers; "reached" only within
    the trainer's tolerance."""
    gap = trainer.target_gap
    if gap is None:
        return "late stage not started: train longer"
    verdict = "reached" if trainer.target_reached else (
        "above the target: train longer" if gap > 0 else "below the target")
    return (f"late stage: size {trainer.size_start:,} -> {trainer.size():,}, target "
            f"{trainer.size_target:,.0f}: {gap:+.1%} ({verdict})")


def result_table(r: dict, batch: int, tokens: int) -> str:
    """The closing table, each column explained once below it."""
    ratio = r["dense_params"] / r["comera_params_end"]
    return "\n".join([
        "",
        "                         dense        CoMERA",
        f"test accuracy (%)   {r['dense_accuracy']:10.1f}    {r['comera_accuracy']:10.1f}",
        f"parameters          {r['dense_params']:10,}    {r['comera_params_end']:10,}"
        f"   {ratio:.1f}x smaller ({r['comera_params_start']:,} after optimize)",
        f"step time (ms)      {r['dense_ms']:10.1f}    {r['comera_early_ms']:10.1f}"
        f"   early stage; {r['comera_late_ms']:.1f} after pruning",
        "",
        "test accuracy: share of 2,048 held-out pairs classified right (3 classes, chance 33%)",
        "parameters: every weight of the model, after training (pruned ranks removed)",
        f"step time: median forward + backward + AdamW, {batch} pairs x {tokens} tokens, eager",
    ])
