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


CACHE_CARDS = (5000, 3000, 20)


def cached_dlrm():
    """A small DLRM whose two large tables carry filled hot-row caches (sparse gradients)."""
    from dlrm_model import DLRM, SyntheticClicks

    import comera_compile as cc

    torch.manual_seed(0)
    data = SyntheticClicks(CACHE_CARDS)
    config = cc.CompressionConfig(budget="10x", compile=False, row_cache=0.5, cache_warmup=0)
    model = cc.optimize(DLRM(CACHE_CARDS, bottom=(16,), top=(16,)), config,
                        example_inputs=data.batch(64, seed=0)[:2]).double()
    sample = data.batch(512, seed=1)[1]
    for i in (0, 1):
        model.tables[i].fill_cache(sample[i])
    return model, data


def cache_train(forward, params, batches):
    import torch.nn.functional as F

    opt = torch.optim.SGD(params, lr=0.1)
    for dense, sparse, labels in batches:
        loss = F.binary_cross_entropy_with_logits(forward(dense.double(), sparse), labels.double())
        opt.zero_grad()
        loss.backward()
        opt.step()


def cache_batches(data, rank=None):
    batches = [data.batch(64, seed=10 + s) for s in range(4)]
    if rank is None:
        return batches
    half = slice(rank * 32, (rank + 1) * 32)
    return [(d[half], s[:, half], y[half]) for d, s, y in batches]


def _cache_worker(rank, path):
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}/store", rank=rank, world_size=WORLD)
    try:
        model, data = cached_dlrm()
        ddp = DistributedDataParallel(model)
        cache_train(ddp, model.parameters(), cache_batches(data, rank))
        # counting during training: each rank sees other ids, all take rank 0's set
        from comera_compile.nn import TTEmbedding

        torch.manual_seed(0)
        warm = TTEmbedding(CACHE_CARDS[0], 16, ranks=4, mode="sum", cache_rows=64, cache_warmup=2)
        for step in range(2):
            warm(data.batch(32, seed=100 * rank + step)[1][0])
        torch.save({"state": model.state_dict(), "warm_ids": warm.cache.ids.clone()},
                   f"{path}/rank{rank}.pt")
        del ddp
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_with_hot_row_caches_equals_one_process_on_the_whole_batch(tmp_path):
    """Sparse cache gradients all-reduced by DDP: two ranks on half batches end where one
    process on the whole batches does; a cache filled by counting takes rank 0's set on
    every rank."""
    os.environ.pop("TORCHELASTIC_RUN_ID", None)
    mp.spawn(_cache_worker, args=(str(tmp_path),), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    torch.set_num_threads(1)
    single, data = cached_dlrm()
    cache_train(single, single.parameters(), cache_batches(data))
    expected = single.state_dict()
    assert single.tables[0].cache.weight.numel() > 0
    for name, value in expected.items():
        if not torch.is_tensor(value) or name.endswith("_extra_state"):
            continue
        torch.testing.assert_close(ranks[0]["state"][name], value, rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(ranks[1]["state"][name], value, rtol=1e-9, atol=1e-10)
    assert torch.equal(ranks[0]["warm_ids"], ranks[1]["warm_ids"])
    assert int((ranks[0]["warm_ids"] >= 0).sum()) > 0
