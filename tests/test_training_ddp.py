"""Rank-adaptive training under DistributedDataParallel (2 CPU processes, gloo): pruning
rebuilds the DDP wrapper, every rank prunes the same, and the result equals one process
trained on the concatenated batch."""

import gc
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from models import small_tt_model, toy_classes, train_steps

from comera_compile.training import PrunableDDP, RankAdaptiveTrainer, param_groups

STEPS = 14
WORLD = 2


def small_model():
    return small_tt_model()


def full_batch(n=48):
    return toy_classes(n)


def train(model, forward, x, y):
    """The same loop for both runs; a schedule that forces channels off mid-run."""
    opt = torch.optim.AdamW(param_groups(model, lr_cores=1e-2, lr_gates=1e-2, lr_rest=1e-2))
    trainer = RankAdaptiveTrainer(
        forward, opt, early_steps=4, prune_every=3, target_ratio=0.5, total_steps=STEPS
    )
    train_steps(forward, opt, trainer, x, y, STEPS)
    return trainer


def _worker(rank, path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}/store", rank=rank, world_size=WORLD)
    try:
        model = small_model()
        ddp = PrunableDDP(model)
        x, y = full_batch()
        half = x.shape[0] // WORLD
        mine = slice(rank * half, (rank + 1) * half)
        trainer = train(model, ddp, x[mine], y[mine])
        torch.save(
            {
                "state": model.state_dict(),
                "rebuilds": ddp.rebuilds,
                "lams": trainer.history.column("lam"),
            },
            f"{path}/rank{rank}.pt",
        )
        # DDP's reducer must not hold the last reference to the process group: freed
        # after destroy_process_group, gloo's destructor joins its worker thread while
        # holding the GIL that thread needs (a hang at exit)
        del ddp, trainer
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_process_ddp_with_pruning_equals_one_process_on_the_whole_batch(tmp_path):
    os.environ.pop("TORCHELASTIC_RUN_ID", None)
    mp.spawn(_worker, args=(str(tmp_path),), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]

    torch.set_num_threads(1)
    single = small_model()
    x, y = full_batch()
    trainer = train(single, single, x, y)
    expected = single.state_dict()

    assert ranks[0]["rebuilds"] >= 1  # pruning happened, and DDP was rebuilt for it
    assert single[0].ranks != [1, 4, 4, 4, 1]  # the schedule really shrank the model
    assert ranks[0]["lams"] == ranks[1]["lams"] == trainer.history.column("lam")
    for name, value in expected.items():
        if not torch.is_tensor(value):
            assert ranks[0]["state"][name] == ranks[1]["state"][name] == value  # layouts
            continue
        assert torch.equal(ranks[0]["state"][name], ranks[1]["state"][name]), name
        torch.testing.assert_close(ranks[0]["state"][name], value, rtol=0, atol=1e-5)
