"""The two CPU kernel choices of the compiled step, each against what it replaces.

1. Dropout: aten's ``native_dropout`` (one float draw per element, ``bernoulli_``) against
   softmax + dropout compiled by inductor with aten's dropout and with
   ``compile.cpu.dropout``'s masks hashed from element indices, on the attention probabilities
   of one six-encoder layer at batch 32 x 128 (6.3M elements).
2. Bond padding: a TT layer's activation matmuls ``x @ B @ C`` (forward + backward, 4096
   rows) at a rank as is and padded to ``planner.alignment.aligned_rank``; and the GFLOP/s
   of ``x @ B`` alone at the two widths.
3. Inductor's generated CPU loops against aten's kernels for the same math on a
   4096 x 3072 activation: GELU, GELU backward, and a sum over rows (a bias gradient);
   and inductor with ``compile.cpu.reductions``' row sums in blocks (the backend's CPU pass).
4. Matmul orientation: a thin weight gradient ``h.T @ dy`` (``h`` of 4096 x rank) as
   written and as its transposed problem ``(dy.T @ h).T`` (``compile.cpu.matmul_orientation``);
   each over eight operand pairs in turn, so the operands come from memory as in a step;
   one float64 row (dgemm, which the backend leaves as written).
5. Sibling products: ``x @ U_i`` for factors ``U_i`` that read one activation (CoLA's
   Q, K, V first factors, gate and up), forward and backward (the input gradient summed
   over the siblings, each factor's gradient), one product each against one product of
   the joined factors (``compile.graph.sibling_matmuls``), over four activations in turn.
6. Host memory: GELU then a scale over a 4096 x 3072 activation (what one FFN of a
   six-encoder layer allocates at batch 32 x 128) with freed blocks released at once,
   which maps each such block anew, with ``compile.cpu.host_memory`` reuse (glibc's heap) and
   with its block cache; minor page faults per call next to the time. Runs last: the
   setting is process-wide.

    python benchmarks/kernels.py              # one thread
    python benchmarks/kernels.py --threads 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import median_seconds, table  # noqa: E402

from comera_compile.cli.machine import describe_machine  # noqa: E402
from comera_compile.compile.cpu.host_memory import set_host_memory  # noqa: E402
from comera_compile.compile.cpu.reductions import SplitRowSums  # noqa: E402
from comera_compile.planner.alignment import aligned_rank  # noqa: E402

ROWS = 4096
CHAINS = [(768, 30, 768), (768, 30, 3072), (3072, 30, 768), (768, 46, 768), (768, 36, 768)]


def dropout_rows(repeats: int) -> list[list[str]]:
    import torch._inductor.config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    from comera_compile.compile.cpu.dropout import decompositions

    x = torch.randn(32, 12, 128, 128)
    aten = median_seconds(lambda: torch.native_dropout(x, 0.1, True), repeats)
    rows = [["aten native_dropout (eager)", f"{aten * 1e3:.1f}", "1.00x"]]

    def attention_dropout(scores):
        return F.dropout(scores.softmax(-1), 0.1, training=True)

    for name, decomposed in (("inductor: softmax + aten dropout", None),
                             ("inductor: softmax + hashed mask", decompositions())):
        def backend(gm, inputs, decomposed=decomposed):
            return compile_fx(gm, inputs, decompositions=decomposed,
                              config_patches={"fallback_random": True})

        with inductor_config.patch(fx_graph_cache=False):
            torch._dynamo.reset()
            compiled = torch.compile(attention_dropout, backend=backend)
            compiled(x)
            seconds = median_seconds(lambda compiled=compiled: compiled(x), repeats)
        rows.append([name, f"{seconds * 1e3:.1f}", f"{aten / seconds:.2f}x"])
    return rows


def chain_seconds(d_in: int, rank: int, d_out: int, padded: int, repeats: int) -> float:
    x = torch.randn(ROWS, d_in, requires_grad=True)
    b = torch.randn(d_in, rank, requires_grad=True)
    c = torch.randn(rank, d_out, requires_grad=True)
    grad = torch.randn(ROWS, d_out)
    extra = padded - rank

    def step() -> None:
        y = (x @ F.pad(b, (0, extra))) @ F.pad(c, (0, 0, 0, extra))
        y.backward(grad)

    return median_seconds(step, repeats)


def padding_rows(repeats: int) -> list[list[str]]:
    rows = []
    for d_in, rank, d_out in CHAINS:
        to = -(-rank // 16) * 16
        plain = chain_seconds(d_in, rank, d_out, rank, repeats)
        padded = chain_seconds(d_in, rank, d_out, to, repeats)
        rows.append([f"{d_in}-{rank}-{d_out}", f"{rank} -> {to}", f"{plain * 1e3:.1f}",
                     f"{padded * 1e3:.1f}", f"{plain / padded:.2f}x",
                     "yes" if aligned_rank(rank) != rank else "no"])
    return rows


def gflops_rows(repeats: int) -> list[list[str]]:
    x = torch.randn(ROWS, 768)
    rows = []
    for width in (30, 32):
        b = torch.randn(768, width)
        seconds = median_seconds(lambda b=b: x @ b, repeats)
        rows.append([f"{ROWS} x 768 @ 768 x {width}",
                     f"{2 * ROWS * 768 * width / seconds / 1e9:.1f}"])
    return rows


def inductor_rows(repeats: int) -> list[list[str]]:
    x, grad = torch.randn(ROWS, 3072), torch.randn(ROWS, 3072)
    ops = {
        "GELU": (lambda x, g: F.gelu(x), (x, grad)),
        "GELU backward": (lambda x, g: torch.ops.aten.gelu_backward(g, x), (x, grad)),
        "sum over rows": (lambda x, g: x.sum(0), (x, grad)),
    }
    rows = []
    for name, (fn, args) in ops.items():
        aten_s = median_seconds(lambda fn=fn, args=args: fn(*args), repeats)
        compiled = torch.compile(fn, backend="inductor")
        inductor_s = median_seconds(lambda f=compiled, args=args: f(*args), repeats)
        blocked = torch.compile(fn, backend="inductor",
                                options={"post_grad_custom_pre_pass": SplitRowSums()})
        blocked_s = median_seconds(lambda f=blocked, args=args: f(*args), repeats)
        rows.append([name, f"{aten_s * 1e3:.1f}", f"{inductor_s * 1e3:.1f}",
                     f"{inductor_s / aten_s:.2f}x", f"{blocked_s * 1e3:.1f}"])
    return rows


def orientation_rows(repeats: int) -> list[list[str]]:
    from comera_compile.compile.cpu.matmul_orientation import worth_turning

    rows = []
    shapes = [(9, 768, torch.float32), (14, 1024, torch.float32), (20, 2048, torch.float32),
              (16, 768, torch.float32), (32, 768, torch.float32), (32, 1536, torch.float32),
              (32, 3072, torch.float32), (64, 768, torch.float32), (32, 768, torch.float64)]
    for rank, width, dtype in shapes:
        pairs = [(torch.randn(ROWS, rank, dtype=dtype), torch.randn(ROWS, width, dtype=dtype))
                 for _ in range(8)]

        def each(fn, pairs=pairs):
            return lambda: [fn(h, dy) for h, dy in pairs]

        written = median_seconds(each(lambda h, dy: h.T @ dy), repeats) / len(pairs)
        turned = median_seconds(each(lambda h, dy: (dy.T @ h).T), repeats) / len(pairs)
        turns = dtype == torch.float32 and worth_turning(rank, ROWS, width)  # the pass's test
        rows.append([f"{rank} x {ROWS} x {width}", str(dtype).removeprefix("torch."),
                     f"{written * 1e3:.2f}", f"{turned * 1e3:.2f}", f"{written / turned:.2f}x",
                     "yes" if turns else "no"])
    return rows


def sibling_rows(repeats: int) -> list[list[str]]:
    from comera_compile.compile.graph.sibling_matmuls import MAX_WIDTH

    rows = []
    for width, ranks in ((384, (47, 25, 24)), (384, (72, 72)), (768, (40, 40, 40)),
                         (768, (96, 96)), (1024, (160, 160)), (768, (768, 768, 768))):
        xs = [torch.randn(ROWS, width) for _ in range(4)]
        gs = [[torch.randn(ROWS, r) for r in ranks] for _ in range(4)]
        us = [torch.randn(width, r) for r in ranks]

        def separate(xs=xs, gs=gs, us=us):
            for x, g in zip(xs, gs):
                [x @ u for u in us]
                sum(gi @ u.T for gi, u in zip(g, us))
                [x.T @ gi for gi in g]

        def joined(xs=xs, gs=gs, us=us, ranks=ranks):
            for x, g in zip(xs, gs):
                u, g = torch.cat(us, 1), torch.cat(g, 1)  # backward of the split: one cat
                x @ u
                g @ u.T
                (x.T @ g).split(list(ranks), 1)

        apart = median_seconds(separate, repeats) / len(xs)
        one = median_seconds(joined, repeats) / len(xs)
        join = all(r <= MAX_WIDTH for r in ranks)
        rows.append([f"{width} x {list(ranks)}", f"{apart * 1e3:.2f}", f"{one * 1e3:.2f}",
                     f"{apart / one:.2f}x", "yes" if join else "no"])
    return rows


def host_memory_rows(repeats: int) -> list[list[str]]:
    """Each allocator from a trimmed heap (so no setting serves another's freed blocks),
    warmed up, then timed; the page faults are those of the timed calls only."""
    import resource

    from comera_compile.compile.cpu.host_memory import release_free_heap

    x = torch.randn(ROWS, 3072)
    rows, first = [], None
    for setting in ("release", "reuse", "cache"):
        if not set_host_memory(setting):
            rows.append([f"{setting} (not available here)", "-", "-", "-"])
            continue
        release_free_heap()
        for _ in range(3):
            F.gelu(x) * 2.0
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        seconds = median_seconds(lambda: F.gelu(x) * 2.0, repeats, warmup=0)
        faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / repeats
        first = first or seconds
        rows.append([setting, f"{seconds * 1e3:.1f}", f"{faults:,.0f}", f"{first / seconds:.2f}x"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(describe_machine())
    print("\ndropout of 6.3M attention probabilities, forward (ms, median):")
    print(table(dropout_rows(args.repeats), ["kernel", "ms", "speed-up"]))
    print(f"\nx @ B @ C, forward + backward, {ROWS} rows (ms, median):")
    print(table(padding_rows(args.repeats),
                ["chain", "rank", "as is", "padded", "speed-up", "padded by default"]))
    print("\nsgemm alone:")
    print(table(gflops_rows(args.repeats), ["product", "GFLOP/s"]))
    print("\nthin weight gradient h.T @ dy, as written and transposed (ms, median):")
    print(table(orientation_rows(args.repeats),
                ["m x k x n", "dtype", "h.T @ dy", "(dy.T @ h).T", "speed-up",
                 "turned by the backend"]))
    print(f"\naten vs inductor on a {ROWS} x 3072 activation (ms, median; host memory reused):")
    set_host_memory("reuse")
    print(table(inductor_rows(args.repeats),
                ["op", "aten", "inductor", "inductor/aten", "inductor, row sums in blocks"]))
    print(f"\nsibling products x @ U_i, forward + backward, {ROWS} rows (ms, median):")
    print(table(sibling_rows(args.repeats),
                ["width x ranks", "one product each", "joined", "speed-up",
                 "joined by the backend"]))
    print(f"\nGELU(x) * 2 on a {ROWS} x 3072 activation, by host allocator (ms, median):")
    print(table(host_memory_rows(args.repeats),
                ["allocator", "ms", "page faults per call", "speed-up"]))


if __name__ == "__main__":
    main()
