"""Shapes under the ``comera`` backend: one graph per plan bucket (not per batch size), one
recompile per prune, ranks rounded to aligned sizes, autotuning on real tensors."""

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import comera_compile.compile as cc
from comera_compile.compile.backend import comera_backend
from comera_compile.nn import TTLinear, TTMLinear
from comera_compile.planner import clear_memory_cache, planning
from comera_compile.planner.ops import row_bucket


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(TTLinear(64, 48, ranks=4), nn.GELU(), TTMLinear(48, 40, ranks=3))


class CountingBackend:
    """The comera backend (AOT autograd, eager kernels), counting the graphs it compiles."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm, example_inputs, **kwargs):
        self.graphs += 1
        return comera_backend(gm, example_inputs, options={"inductor": False})


def test_row_bucket_is_the_next_power_of_two():
    assert [row_bucket(n) for n in (0, 1, 2, 3, 4, 5, 1000, 1024, 1025)] == [
        1, 1, 2, 4, 4, 8, 1024, 1024, 2048,
    ]


def test_eight_batch_sizes_compile_at_most_four_graphs():
    model = mlp()
    backend = CountingBackend()
    compiled = torch.compile(model, backend=backend)
    for batch in range(1, 9):  # 16..128 rows: buckets 16, 32, 64, 128
        x = torch.randn(batch, 16, 64)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert backend.graphs == 4
    buckets = {k[4] for k in cc.traced_plans() if k[1:3] == ((8, 8), (6, 8))}
    assert {16, 32, 64, 128} <= buckets


def test_a_prune_recompiles_once_and_keeps_outputs():
    model = mlp()
    backend = CountingBackend()
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(6, 64)
    compiled(x)
    with torch.no_grad():
        model[0].gates[0][:2] = 0.0
        model[2].gates[0][:1] = 0.0
    before = model(x)
    assert model[0].prune_ranks().total_removed == 2
    assert model[2].prune_ranks().total_removed == 1
    torch.testing.assert_close(model(x), before, rtol=1e-5, atol=1e-6)
    for _ in range(3):
        torch.testing.assert_close(compiled(x), before, rtol=1e-5, atol=1e-6)
    assert backend.graphs == 2


def test_prune_rounds_kept_ranks_to_a_multiple():
    torch.manual_seed(0)
    layer = TTLinear(64, 64, ranks=20, in_modes=[4, 4, 4], out_modes=[4, 4, 4])
    x = torch.randn(5, 64)
    with torch.no_grad():
        layer.gates[2][:9] = 0.0  # 11 alive -> kept 16
        layer.gates[3][:15] = 0.0  # 1 alive (rank 16 bond) -> kept 8
        layer.gates[3][15] = 0.5
        layer.gates[1][:3] = 0.0  # 13 alive of 16 -> kept 16: nothing removed there
    want = layer(x)
    ranks = layer.ranks
    result = layer.prune_ranks(multiple_of=8)
    assert layer.ranks == [1, ranks[1], ranks[2], 16, 8, ranks[5], 1]
    assert result.removed == [0, 0, ranks[3] - 16, ranks[4] - 8, 0]
    assert layer.effective_ranks()[3:5] == [11, 1]  # rounded channels stay switched off
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="multiple_of"):
        layer.prune_ranks(multiple_of=0)


def test_autotune_under_compile_times_real_tensors(monkeypatch):
    clear_memory_cache()
    seen = []
    original = planning.fastest

    def spy(candidates, operands, device_type):
        seen.append([isinstance(op, FakeTensor) for op in operands])
        return original(candidates, operands, device_type)

    monkeypatch.setattr(planning, "fastest", spy)
    torch.manual_seed(0)
    model = nn.Sequential(TTLinear(256, 256, ranks=8, in_modes=[4, 8, 8], out_modes=[8, 8, 4]))
    compiled = torch.compile(
        model, backend="comera", options={"autotune": True, "inductor": False}
    )
    x = torch.randn(48, 256)
    torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert seen and not any(any(fakes) for fakes in seen)
    plans = [p for k, p in cc.traced_plans().items() if k[1] == (4, 8, 8) and k[4] == 64]
    assert plans and all(p.autotuned for p in plans)
    clear_memory_cache()
