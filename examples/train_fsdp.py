"""Rank-adaptive training of a small LLaMA under FSDP2, pruning included.

    torchrun --nproc_per_node=2 examples/train_fsdp.py            # CPU: gloo
    torchrun --nproc_per_node=8 examples/train_fsdp.py --steps 400  # GPUs: nccl (untested)

Each rank trains on its own slice of the batch; the cores are sharded per decoder layer,
the rank gates are whole on every rank, and each prune gathers, cuts and re-shards the
blocks that lost channels. Halfway through, the run saves a sharded checkpoint and resumes
from it into a freshly built model, as a restart would.
"""

import argparse
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import comera_compile as cc
from comera_compile.training import (
    RankAdaptiveTrainer,
    cut_to_checkpoint,
    load_checkpoint,
    param_groups,
    save_checkpoint,
    shard,
)


def build() -> torch.nn.Module:
    """The same model on every rank (same seed), tensorized to 60% of its parameters."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
    return cc.optimize(LlamaForCausalLM(config), budget=0.6, compile=False)


def batch(step: int, world: int) -> torch.Tensor:
    """Counting sequences (start, start + stride, ...) mod 256: learnable next tokens."""
    generator = torch.Generator().manual_seed(step)
    start = torch.randint(0, 256, (8 * world, 1), generator=generator)
    stride = torch.randint(1, 4, (8 * world, 1), generator=generator)
    return (start + stride * torch.arange(32)) % 256


def train(model, optimizer, trainer, steps, rank, world, device):
    for _ in range(steps):
        tokens = batch(trainer.steps, world).chunk(world)[rank].to(device)  # this rank's slice
        loss = trainer.loss(model(input_ids=tokens, labels=tokens).loss)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        trainer.step()
        if (trainer.last_pruned or trainer.steps % 10 == 0) and rank == 0:
            q_proj = trainer.history.column("ranks")[-1]["model.layers.0.self_attn.q_proj"]
            print(f"step {trainer.steps:3d}  {trainer.stage:5s}  loss {loss.item():.3f}  "
                  f"size {trainer.size():,}  layers.0 q_proj ranks {q_proj}  "
                  f"pruned {len(trainer.last_pruned)} layers", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)

    def make(model):
        optimizer = torch.optim.AdamW(param_groups(model, lr=1e-2))
        trainer = RankAdaptiveTrainer(model, optimizer, target_ratio=0.5, early_steps=20,
                                      prune_every=10, total_steps=args.steps)
        return optimizer, trainer

    model = shard(build().to(device))  # each decoder layer, then the root
    optimizer, trainer = make(model)
    size = trainer.size()
    if rank == 0:
        print(f"{world} ranks, {size:,} parameters; cores sharded, rank gates whole", flush=True)
    train(model, optimizer, trainer, args.steps // 2, rank, world, device)

    directory = tempfile.mkdtemp() if rank == 0 else None
    shared = [directory]
    dist.broadcast_object_list(shared)  # one directory for every rank (a shared disk)
    save_checkpoint(shared[0], model, optimizer, trainer)
    del model, optimizer, trainer

    model = build()
    cut_to_checkpoint(model, shared[0])  # the fresh model takes the pruned ranks first
    model = shard(model.to(device))
    optimizer, trainer = make(model)
    load_checkpoint(shared[0], model, optimizer, trainer)
    if rank == 0:
        print(f"resumed at step {trainer.steps} from {shared[0]}", flush=True)
    train(model, optimizer, trainer, args.steps - trainer.steps, rank, world, device)
    if rank == 0:
        print(f"size {size:,} -> {trainer.size():,} parameters, trained on {world} ranks")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(shared[0])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
