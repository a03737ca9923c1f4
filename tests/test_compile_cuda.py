"""The ``comera`` backend and the captured train step on CUDA: CUDA Graph replay equals
eager, pruning re-records, and a replayed step never waits on the host."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import comera_compile.compile as cc
from comera_compile.cli.six_encoder import SixEncoderClassifier, SixEncoderConfig
from comera_compile.nn import TTEmbedding, TTLinear

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEVICE = "cuda"


@pytest.fixture(autouse=True)
def _exact_cuda():
    """No TF32, fresh dynamo caches: compare against eager at fp32 precision."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
    torch.cuda.set_sync_debug_mode(0)


def six_encoder() -> nn.Module:
    torch.manual_seed(0)
    config = SixEncoderConfig(
        vocab_size=1000, hidden=96, ffn=384, heads=4, layers=2, max_position=64, dropout=0.0
    )
    model = SixEncoderClassifier(config)
    for layer in model.layers:
        for name in ("query", "key", "value", "out"):
            setattr(layer.attention, name, TTLinear(96, 96, ranks=6))
        layer.ffn.fc_in = TTLinear(96, 384, ranks=6)
        layer.ffn.fc_out = TTLinear(384, 96, ranks=6)
    model.fc1 = TTLinear(96, 96, ranks=6)
    model.word_embeddings = TTEmbedding(1000, 96, ranks=8)
    return model.to(DEVICE)


def batch(rows: int = 4, seq: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 1000, (rows, seq), generator=g)
    labels = torch.randint(0, 3, (rows,), generator=g)
    return ids.to(DEVICE), labels.to(DEVICE)


def loss_fn(model, data):
    ids, labels = data
    return F.cross_entropy(model(ids), labels)


def prune_half_of_first_bond(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Switch off half of every TT layer's first bond, prune, slice AdamW's state to match."""
    removed = 0
    for module in model.modules():
        if not isinstance(module, (TTLinear, TTEmbedding)):
            continue
        with torch.no_grad():
            gate = module.gates[0]
            gate[: gate.numel() // 2] = 0.0
        result = module.prune_ranks(multiple_of=1)  # CUDA's default keeps multiples of 8
        removed += result.total_removed
        for param, dim, index in result.slices:
            state = optimizer.state.get(param, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].index_select(dim, index)
    return removed


def test_backend_replay_equals_eager_and_rerecords_on_new_shapes():
    model = six_encoder().eval()
    compiled = torch.compile(model, backend="comera")
    torch._dynamo.utils.counters.clear()
    for rows in (4, 8, 4):  # the third call replays the first recording
        ids, _ = batch(rows)
        with torch.no_grad():
            want = model(ids)
            got = compiled(ids).clone()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert not torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
    prune_half_of_first_bond(model, torch.optim.AdamW(model.parameters()))
    ids, _ = batch(4)
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids).clone(), model(ids), rtol=1e-4, atol=1e-5)


def test_backend_gradients_match_eager_under_cudagraphs():
    model = six_encoder()
    compiled = torch.compile(model, backend="comera", options={"cudagraphs": True})
    ids, labels = batch(4)
    grads = []
    for fn in (model, compiled):
        model.zero_grad(set_to_none=True)
        F.cross_entropy(fn(ids), labels).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None})
    assert grads[1].keys() == grads[0].keys()
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_captured_step_equals_eager_steps():
    eager_model = six_encoder()
    graph_model = copy.deepcopy(eager_model)
    eager_opt = torch.optim.AdamW(eager_model.parameters(), lr=1e-3, weight_decay=0.0)
    graph_opt = torch.optim.AdamW(graph_model.parameters(), lr=1e-3, weight_decay=0.0)
    step = cc.capture_train_step(graph_model, graph_opt, loss_fn, batch(4, seed=0))
    assert step.records == 1
    assert all(group["capturable"] for group in graph_opt.param_groups)
    # warm-up steps were undone: both models start from the same parameters
    for p, q in zip(eager_model.parameters(), graph_model.parameters()):
        torch.testing.assert_close(q, p)
    for seed in range(3):
        data = batch(4, seed=seed)
        eager_opt.zero_grad(set_to_none=True)
        want = loss_fn(eager_model, data)
        want.backward()
        eager_opt.step()
        got = step(data).clone()
        torch.testing.assert_close(got, want.detach(), rtol=1e-4, atol=1e-5)
    assert step.records == 1
    for (name, p), q in zip(eager_model.named_parameters(), graph_model.parameters()):
        # a key bias's gradient is zero in exact arithmetic (softmax ignores a shift), so
        # each form holds rounding noise there, which AdamW turns into lr-sized steps
        atol = 3 * 1e-3 if name.endswith("key.bias") else 1e-5
        torch.testing.assert_close(q, p, rtol=1e-4, atol=atol, msg=name)


def test_pruning_rerecords_the_step_automatically():
    model = six_encoder()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    step = cc.capture_train_step(model, optimizer, loss_fn, batch(4))
    for seed in range(2):
        step(batch(4, seed=seed))
    shapes = [tuple(p.shape) for p in model.parameters()]
    assert prune_half_of_first_bond(model, optimizer) > 0
    assert [tuple(p.shape) for p in model.parameters()] != shapes
    data = batch(4, seed=5)
    with torch.no_grad():
        want = loss_fn(model, data)  # the loss before this step's update
    got = step(data).clone()
    assert step.records == 2
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        assert float(loss_fn(model, data)) < float(want)  # the replayed step did update
    step.rerecord()
    step(data)
    assert step.records == 3


def test_replayed_step_never_syncs_with_the_host():
    model = six_encoder()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    step = cc.capture_train_step(model, optimizer, loss_fn, batch(4))
    data = [batch(4, seed=s) for s in range(3)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        losses = [step(d).clone() for d in data]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert step.records == 1
    assert all(torch.isfinite(loss).item() for loss in losses)


def test_compiled_captured_step_trains():
    model = six_encoder()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    data = batch(8)
    step = cc.capture_train_step(model, optimizer, loss_fn, data, compile=True)
    losses = [step(data).item() for _ in range(10)]
    assert losses[-1] < losses[0]


def test_lr_scheduler_acts_on_the_replayed_step():
    model = six_encoder()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 0.0 if epoch else 1.0)
    step = cc.capture_train_step(model, optimizer, loss_fn, batch(4))
    step(batch(4))
    scheduler.step()  # lr -> 0: the next replay must leave the parameters alone
    before = [p.detach().clone() for p in model.parameters()]
    step(batch(4, seed=1))
    assert step.records == 1
    for p, q in zip(before, model.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0)


def test_compiled_model_and_cpu_batch_are_captured_like_eager():
    eager_model = six_encoder()
    graph_model = copy.deepcopy(eager_model)
    eager_opt = torch.optim.AdamW(eager_model.parameters(), lr=1e-3, weight_decay=0.0)
    graph_opt = torch.optim.AdamW(graph_model.parameters(), lr=1e-3, weight_decay=0.0)
    compiled = cc.compile_model(graph_model)  # cudagraph trees inside: must be unwrapped
    cpu_batch = tuple(t.cpu() for t in batch(4))
    step = cc.capture_train_step(compiled, graph_opt, loss_fn, cpu_batch)
    for seed in range(2):
        data = batch(4, seed=seed)
        eager_opt.zero_grad(set_to_none=True)
        want = loss_fn(eager_model, data)
        want.backward()
        eager_opt.step()
        got = step(tuple(t.cpu() for t in data)).clone()
        torch.testing.assert_close(got, want.detach(), rtol=1e-4, atol=1e-5)
    assert step.records == 1


def test_warmup_restores_nadam_state():
    eager_model = six_encoder()
    graph_model = copy.deepcopy(eager_model)
    eager_opt = torch.optim.NAdam(eager_model.parameters(), lr=1e-3)
    graph_opt = torch.optim.NAdam(graph_model.parameters(), lr=1e-3)
    step = cc.capture_train_step(graph_model, graph_opt, loss_fn, batch(4))
    data = batch(4, seed=3)
    eager_opt.zero_grad(set_to_none=True)
    loss_fn(eager_model, data).backward()
    eager_opt.step()
    step(data)
    for p, q in zip(eager_model.parameters(), graph_model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5)


def test_symbolic_ranks_survive_a_cut_under_cudagraphs():
    from comera_compile.compile.backend import graphs_compiled

    eager_model = six_encoder()
    model = copy.deepcopy(eager_model)
    cc.compile_model(model, inplace=True, blocks=True, symbolic_ranks=True)  # CUDA Graph trees
    ids, labels = batch(4)
    for fn in (eager_model, model):
        F.cross_entropy(fn(ids), labels).backward()
    optimizers = [torch.optim.AdamW(m.parameters()) for m in (eager_model, model)]
    for m, opt in zip((eager_model, model), optimizers):
        assert prune_half_of_first_bond(m, opt) > 0
    before = graphs_compiled()
    for _ in range(2):  # the second call replays what the first recorded
        grads = []
        for m in (eager_model, model):
            m.zero_grad(set_to_none=True)
            loss = F.cross_entropy(m(ids), labels)
            loss.backward()
            grads.append({n: p.grad.clone() for n, p in m.named_parameters()
                          if p.grad is not None})
        for name, grad in grads[0].items():
            torch.testing.assert_close(grads[1][name], grad, rtol=1e-4, atol=1e-5, msg=name)
    assert graphs_compiled() == before  # the cut compiled nothing


def test_absorbed_cola_attention_equals_eager_on_cuda():
    """Bonds of 6 (padded to a width of 8 for CUDA's attention kernels), absorbed under
    CUDA Graphs: values and gradients equal eager."""
    from comera_compile.nn import CoLALinear

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v, self.o = (CoLALinear(64, 64, ranks=6) for _ in range(4))

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = (p(x).view(b, t, 2, 32).transpose(1, 2) for p in (self.q, self.k, self.v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o(y.transpose(1, 2).reshape(b, t, c))

    torch.manual_seed(0)
    model = Attention().to(DEVICE)
    x = torch.randn(3, 10, 64, device=DEVICE)
    proj = torch.randn(64, device=DEVICE)
    want = model(x)
    g_want = torch.autograd.grad((want @ proj).square().mean(), list(model.parameters()))
    compiled = cc.compile_model(copy.deepcopy(model))
    for _ in range(3):  # record, then replay
        got = compiled(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    g_got = torch.autograd.grad((got @ proj).square().mean(), list(compiled.parameters()))
    for name, a, b in zip([n for n, _ in model.named_parameters()], g_got, g_want):
        if name == "k.bias":
            continue  # cancelled by the softmax: exact zero through the bonds, noise eager
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5, msg=name)
