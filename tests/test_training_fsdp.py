"""Rank-adaptive training under FSDP2 (2 CPU processes, gloo): a small Hugging Face LLaMA,
sharded per decoder layer, prunes for real; the result equals one process trained on the
concatenated batch; a sharded checkpoint resumes mid-run; disagreement and a failing rank
raise instead of hanging."""

import copy
import functools
import os
import time
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard

import comera_compile as cc
from comera_compile.nn.base import decode_layout
from comera_compile.training import (
    RankAdaptiveTrainer,
    cut_to_checkpoint,
    full_state_dict,
    load_checkpoint,
    param_groups,
    save_checkpoint,
    shard,
)
from comera_compile.training import sharded as sharded_module

transformers = pytest.importorskip("transformers")

STEPS = 14
WORLD = 2
BATCH, SEQ, VOCAB = 8, 16, 64


@functools.cache
def _built():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ,
    )
    # the head named, so compressed too (not held dense): tests prune the root group's lm_head
    compression = cc.CompressionConfig(budget=0.6, compile=False,
                                       layer_config={"lm_head": {"format": "cola"}})
    return cc.optimize(transformers.LlamaForCausalLM(config), compression)


def small_llama():
    """The same optimized LLaMA on every rank and in the single-process run (built once
    per process, a fresh copy each call)."""
    return copy.deepcopy(_built())


def full_batch():
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)


def make_trainer(model, structured=False):
    """``structured``: each core's rate from its fan-in, which pruning changes, so a fresh
    optimizer on a cut model groups the cores differently from the saved one."""
    rates = {"lr": 1e-2} if structured else {"lr_cores": 1e-2, "lr_gates": 1e-2, "lr_rest": 1e-2}
    opt = torch.optim.AdamW(param_groups(model, **rates))
    trainer = RankAdaptiveTrainer(
        model, opt, early_steps=4, prune_every=3, target_ratio=0.5, total_steps=STEPS,
        l2_weight=1e-3,
    )
    return opt, trainer


def run(model, opt, trainer, tokens, steps):
    for _ in range(steps):
        loss = trainer.loss(model(input_ids=tokens, labels=tokens).loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
        trainer.step()


def ranks_of(model):
    return {n: lay.ranks for n, lay in cc.nn.tensorized_layers(model).items()}


def my_half(rank):
    half = BATCH // WORLD
    return full_batch()[rank * half : (rank + 1) * half]


def _init(rank, path, seconds=60):
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # HF returns views
    dist.init_process_group(
        "gloo", init_method=f"file://{path}/store", rank=rank, world_size=WORLD,
        timeout=timedelta(seconds=seconds),
    )


def _spawn(worker, path, *args):
    os.environ.pop("TORCHELASTIC_RUN_ID", None)
    mp.spawn(worker, args=(str(path), *args), nprocs=WORLD, join=True)
    return [torch.load(f"{path}/rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _train_worker(rank, path):
    _init(rank, path)
    try:
        model = shard(small_llama())
        opt, trainer = make_trainer(model)
        run(model, opt, trainer, my_half(rank), STEPS)
        state = full_state_dict(model, cpu_offload=False)
        torch.save(
            {
                "state": state,
                "ranks": ranks_of(model),
                "cuts": trainer.cuts,
                "losses": trainer.history.column("task_loss"),
                "local": [type(p).__name__ for p in model.parameters()],
            },
            f"{path}/rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


def single_process_run(steps=STEPS):
    torch.set_num_threads(1)
    model = small_llama()
    opt, trainer = make_trainer(model)
    run(model, opt, trainer, full_batch(), steps)
    return model, trainer


def assert_state_close(got, expected):
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        if name.endswith("_extra_state"):  # the layouts: pruned ranks
            assert torch.equal(got[name], value), name
            continue
        assert got[name].shape == value.shape, name
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
def test_two_process_fsdp_with_pruning_equals_one_process_on_the_whole_batch(tmp_path):
    ranks = _spawn(_train_worker, tmp_path)
    single, trainer = single_process_run()
    fresh = ranks_of(small_llama())

    assert "DTensor" in ranks[0]["local"]  # the model really was sharded
    assert ranks[0]["cuts"] >= 2 and ranks[0]["cuts"] == trainer.cuts  # pruned, twice or more
    assert ranks[0]["ranks"] == ranks[1]["ranks"] == ranks_of(single) != fresh
    assert sum(map(sum, ranks_of(single).values())) < 0.8 * sum(map(sum, fresh.values()))
    losses = trainer.history.column("task_loss")
    torch.testing.assert_close(ranks[0]["losses"], losses, rtol=1e-5, atol=1e-6)
    for r in range(WORLD):
        assert_state_close(ranks[r]["state"], single.state_dict())


SAVE_AT = 7  # after the prunes at the late stage's start (step 4) and at step 6


def _resume_worker(rank, path):
    _init(rank, path)
    try:
        tokens = my_half(rank)
        model = shard(small_llama())
        opt, trainer = make_trainer(model, structured=True)
        run(model, opt, trainer, tokens, SAVE_AT)
        saved_ranks, saved_cuts = ranks_of(model), trainer.cuts
        saved_groups = len(opt.param_groups)
        save_checkpoint(f"{path}/checkpoint", model, opt, trainer)  # changes nothing
        run(model, opt, trainer, tokens, STEPS - SAVE_AT)  # the uninterrupted run
        straight = full_state_dict(model, cpu_offload=False)
        straight_losses = trainer.history.column("task_loss")
        del model, opt, trainer

        model = small_llama()
        changed = cut_to_checkpoint(model, f"{path}/checkpoint")
        cut_ranks = ranks_of(model)
        shard(model)
        opt, trainer = make_trainer(model, structured=True)
        fresh_groups = len(opt.param_groups)
        load_checkpoint(f"{path}/checkpoint", model, opt, trainer)
        regrouped = len(opt.param_groups)
        assert trainer.steps == SAVE_AT
        run(model, opt, trainer, tokens, STEPS - SAVE_AT)
        gathered = full_state_dict(model)  # rank 0 only, on the CPU
        if rank == 0:  # cc.save from the gathered state: an unsharded model of the same build
            plain = small_llama()
            plain.load_state_dict(gathered)  # cuts its layers to the pruned ranks
            cc.save(plain, f"{path}/saved")
        torch.save(
            {
                "straight": straight,
                "straight_losses": straight_losses,
                "resumed": full_state_dict(model, cpu_offload=False),
                "resumed_losses": trainer.history.column("task_loss"),
                "saved_ranks": saved_ranks,
                "saved_cuts": saved_cuts,
                "cut_ranks": cut_ranks,
                "changed": changed,
                "groups": (saved_groups, fresh_groups, regrouped),
            },
            f"{path}/rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_sharded_checkpoint_after_a_prune_resumes_as_the_uninterrupted_run(tmp_path):
    ranks = _spawn(_resume_worker, tmp_path)
    fresh = ranks_of(small_llama())
    for got in ranks:
        assert got["saved_cuts"] >= 1 and got["saved_ranks"] != fresh  # saved after a prune
        assert got["cut_ranks"] == got["saved_ranks"] and got["changed"] > 0
        assert got["resumed_losses"] == got["straight_losses"]  # history carried over
        saved, fresh_groups, regrouped = got["groups"]
        assert fresh_groups != saved == regrouped  # the optimizer was regrouped as saved
        assert_state_close(got["resumed"], got["straight"])
    assert_state_close(ranks[1]["resumed"], ranks[0]["resumed"])
    loaded = cc.load(tmp_path / "saved")  # a Hugging Face LLaMA rebuilt from config.json
    assert ranks_of(loaded) == ranks_of_state(ranks[0]["resumed"])
    assert_state_close(loaded.state_dict(), ranks[0]["resumed"])


def ranks_of_state(state):
    return {
        key.removesuffix("._extra_state"): decode_layout(value)["ranks"]
        for key, value in state.items()
        if key.endswith("._extra_state")
    }


def test_fully_shard_without_shard_is_refused_by_the_trainer(tmp_path):
    """Sharded gates would turn every step's bookkeeping into collectives: the trainer
    asks for shard(), which keeps them whole (one process, world size 1)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = small_llama()
        fully_shard(model)
        with pytest.raises(ValueError, match="training.shard"):
            make_trainer(model)
        with pytest.raises(ValueError, match="already sharded"):
            shard(model)
    finally:
        dist.destroy_process_group()


def _kill_channels(model):
    """The same dead channels on every rank, in the root's group (lm_head) and a block's."""
    for name in ("lm_head", "model.layers.1.self_attn.q_proj"):
        model.get_submodule(name).gates[0].data[:2] = 0.0


def _error_worker(rank, path, case):
    _init(rank, path, seconds=5)
    saved = False
    try:
        model = shard(small_llama())
        opt, trainer = make_trainer(model)
        run(model, opt, trainer, my_half(rank), 2)
        _kill_channels(model)
        if case == "gates differ" and rank == 1:
            trainer.bank.gates[0].data[-1] += 0.5
        if case == "rank fails" and rank == 1:

            def fail(layer, optimizer):
                raise RuntimeError("injected failure mid-prune")

            sharded_module.prune_layer = fail
        try:
            trainer.prune()
            outcome = "pruned"
        except RuntimeError as exc:
            outcome = str(exc)
        torch.save({"error": outcome}, f"{path}/rank{rank}.pt")
        saved = True
        if case == "rank fails" and rank == 1:  # stay alive, silent: rank 0 must time out
            while not os.path.exists(f"{path}/rank0.pt"):
                time.sleep(0.1)
    finally:
        if saved:  # a gloo group whose collective timed out can abort in its destructor
            os._exit(0)  # (a worker thread still joinable): the result is saved, leave as is
        dist.destroy_process_group()


@pytest.mark.slow
def test_gates_that_differ_between_ranks_raise_on_every_rank(tmp_path):
    ranks = _spawn(_error_worker, tmp_path, "gates differ")
    for got in ranks:
        assert "rank gates differ from rank 0's on 1 of 2 ranks" in got["error"]
    assert "rank 1: differs" in ranks[1]["error"] and "rank 0: same" in ranks[0]["error"]


@pytest.mark.slow
def test_a_rank_failing_mid_prune_is_an_error_on_the_others_not_a_hang(tmp_path):
    ranks = _spawn(_error_worker, tmp_path, "rank fails")
    assert "sharded prune failed on rank 1" in ranks[1]["error"]
    assert "injected failure mid-prune" in ranks[1]["error"]
    # rank 0 went on to the next group's gather: its collective timed out, no endless wait
    assert "sharded prune failed on rank 0 in FSDP group 'model.layers.1'" in ranks[0]["error"]
    assert "timed out" in ranks[0]["error"].lower()
    assert "timed out waiting 5000ms" in ranks[0]["error"].lower()  # the group's timeout


CACHE_CARDS = (5000, 3000, 20)


def cached_dlrm(fill=True):
    """A small DLRM (dense-gradient tables, as FSDP needs) with filled hot-row caches."""
    from dlrm_model import DLRM, SyntheticClicks

    torch.manual_seed(0)
    data = SyntheticClicks(CACHE_CARDS)
    config = cc.CompressionConfig(budget="10x", compile=False, row_cache=0.5, cache_warmup=5)
    model = cc.optimize(DLRM(CACHE_CARDS, bottom=(16,), top=(16,), sparse=False), config,
                        example_inputs=data.batch(64, seed=0)[:2]).double()
    sample = data.batch(512, seed=1)[1]
    for i in (0, 1) if fill else ():
        model.tables[i].fill_cache(sample[i])
    return model, data


def cache_run(model, data, rank=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(4):
        dense, sparse, labels = data.batch(64, seed=10 + s)
        if rank is not None:
            half = slice(rank * 32, (rank + 1) * 32)
            dense, sparse, labels = dense[half], sparse[:, half], labels[half]
        out = model(dense.double(), sparse)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(out, labels.double())
        opt.zero_grad()
        loss.backward()
        opt.step()


def _cache_worker(rank, path):
    _init(rank, path)
    try:
        model, data = cached_dlrm()
        model = shard(model)
        cache_run(model, data, rank)
        torch.save({"state": full_state_dict(model, cpu_offload=False)}, f"{path}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp_with_hot_row_caches_equals_one_process_on_the_whole_batch(tmp_path):
    ranks = _spawn(_cache_worker, tmp_path)
    torch.set_num_threads(1)
    single, data = cached_dlrm()
    cache_run(single, data)
    expected = single.state_dict()
    assert any(".cache.weight" in name for name in expected)
    for got in ranks:
        for name, value in expected.items():
            if name.endswith("_extra_state"):
                continue
            torch.testing.assert_close(got["state"][name].cpu(), value, rtol=1e-9, atol=1e-10,
                                       msg=name)


def test_shard_refuses_a_cache_not_yet_filled():
    model, _ = cached_dlrm(fill=False)
    with pytest.raises(ValueError, match="fill it before shard"):
        shard(model)
