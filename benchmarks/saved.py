"""What a compiled training step keeps from forward to backward, per memory setting.

Compiles the six-encoder (CoMERA paper factorizations, dropout on) with the ``comera``
backend once per ``memory`` setting and prints the buffers the partitioned forward hands
to backward (each once: a saved view and its base are one buffer), grouped by dtype and
shape: the activations ``memory="low"`` keeps, and its dropout masks, kept as bits
(uint8, one byte per eight elements).

    python benchmarks/saved.py                       # batch 32 x 128, default and low
    python benchmarks/saved.py --batch 8 --memory low,0.3
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch
import torch.nn.functional as F


def saved_for_backward(batch: int, seq: int, layers: int, memory: str | float) -> Counter:
    """Bytes the forward keeps for backward, keyed by (dtype, shape)."""
    import torch._inductor.compile_fx as inductor
    from torch.multiprocessing.reductions import StorageWeakRef

    from comera_compile.cli.six_encoder import SixEncoderConfig, reference_tensorized
    from comera_compile.compile import compile_model

    kept: Counter = Counter()
    partition = inductor.min_cut_rematerialization_partition

    def recording_partition(joint, inputs, **kwargs):
        forward, backward = partition(joint, inputs, **kwargs)
        outputs = next(n for n in forward.graph.nodes if n.op == "output").args[0]
        storages = set()  # a saved view and its base are one buffer: count it once
        for node in outputs[kwargs.get("num_fwd_outputs", 1):]:
            value = node.meta.get("val")
            if isinstance(value, torch.Tensor) and node.op != "placeholder":  # not weights
                storage = StorageWeakRef(value.untyped_storage())
                if storage in storages:
                    continue
                storages.add(storage)
                key = (str(value.dtype).removeprefix("torch."), tuple(value.shape))
                kept[key] += value.untyped_storage().nbytes()
        return forward, backward

    torch._dynamo.reset()
    inductor.min_cut_rematerialization_partition = recording_partition
    try:
        config = SixEncoderConfig(layers=layers)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, config.vocab_size, (batch, seq), generator=g)
        labels = torch.randint(0, config.num_labels, (batch,), generator=g)
        torch.manual_seed(0)
        model = reference_tensorized(config).train()
        F.cross_entropy(compile_model(model, memory=memory)(ids), labels).backward()
    finally:
        inductor.min_cut_rematerialization_partition = partition
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--memory", default="default,low")
    args = parser.parse_args()

    from comera_compile.cli.machine import describe_machine

    print(describe_machine())
    print(f"six-encoder, {args.layers} layers, batch {args.batch} x {args.seq}, train mode")
    for setting in args.memory.split(","):
        memory = setting if setting in ("default", "low") else float(setting)
        kept = saved_for_backward(args.batch, args.seq, args.layers, memory)
        masks = sum(b for (dtype, _), b in kept.items() if dtype in ("uint8", "bool"))
        print(f"memory={setting}: {sum(kept.values()) / 2**20:.1f} MB kept for backward, "
              f"{masks / 2**20:.1f} MB of it dropout masks")
        for (dtype, shape), size in kept.most_common(6):
            print(f"    {size / 2**20:8.1f} MB  {dtype} {list(shape)}")


if __name__ == "__main__":
    main()
