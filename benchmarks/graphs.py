"""How many graphs the ``comera`` backend compiles for a run of batch sizes.

Trains the six-encoder (CoMERA paper factorizations, train mode with dropout, AdamW) one
step per batch size through ``torch.compile(backend="comera")`` and prints, after each
step, the number of graphs compiled so far and the step's wall time (compiling included).
``--why`` prints dynamo's reason for each recompile (the guard that failed).

    python benchmarks/graphs.py                            # 1 layer, batches 1..32
    python benchmarks/graphs.py --layers 2 --batches 1,4,16,64
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from comera_compile.cli.machine import describe_machine
from comera_compile.cli.six_encoder import SixEncoderConfig, reference_tensorized
from comera_compile.compile.backend import comera_backend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batches", default="1,2,3,5,8,13,21,32")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--why", action="store_true", help="log dynamo's recompile reasons")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.why:
        torch._logging.set_logs(recompiles=True)
    print(describe_machine())
    graphs = []

    def counting(gm, example_inputs, **kwargs):
        graphs.append(gm)
        return comera_backend(gm, example_inputs, **kwargs)

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    config = SixEncoderConfig(layers=args.layers)
    torch.manual_seed(0)
    model = reference_tensorized(config).train()
    compiled = torch.compile(model, backend=counting)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    print(f"six-encoder, {args.layers} layer(s), seq {args.seq}, train mode, one step per size")
    for batch in (int(b) for b in args.batches.split(",")):
        ids = torch.randint(0, config.vocab_size, (batch, args.seq))
        labels = torch.randint(0, config.num_labels, (batch,))
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(compiled(ids), labels).backward()
        optimizer.step()
        seconds = time.perf_counter() - start
        print(f"batch {batch:5d}: {len(graphs)} graph(s) so far, step {seconds:7.2f} s")
    print(f"{len(graphs)} graphs for {len(args.batches.split(','))} batch sizes")


if __name__ == "__main__":
    main()
