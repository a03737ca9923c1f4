"""A forward that reads a layer's ``.weight`` itself (``F.linear(x, self.lin.weight)``)
besides calling the layer: capture sees the read, the layer stays dense and the summary says
why; where no graph was captured, reading a tensorized layer's weight raises instead of
computing with values that do not exist."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import comera_compile as cc
from comera_compile.nn import TensorizedLayer

X = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
WHY = "reads 'lin.weight' directly"


class ReadsWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.up = nn.Linear(64, 256)
        self.down = nn.Linear(256, 64)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + F.linear(x, self.lin.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.body(x))))


class ReadsWeightOptional(ReadsWeight):
    """An optional argument: fx would freeze its branch, so the graph comes from export."""

    def forward(self, x: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        out = super().forward(x)
        return out if scale is None else out * scale


class ReadsWeightUntraceable(ReadsWeight):
    """Data-dependent control flow: no fx graph, and without example inputs no export."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            x = x * 1.0
        return super().forward(x)


def expected(model: ReadsWeight, optimized: ReadsWeight) -> torch.Tensor:
    """The optimized model's forward with its ``lin`` replaced by the original dense one."""
    h = model.lin(X) + X @ model.lin.weight.T
    return optimized.down(torch.relu(optimized.up(h)))


@pytest.mark.parametrize("cls, path", [(ReadsWeight, "fx"), (ReadsWeightOptional, "export")])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_layer_whose_weight_the_forward_reads_stays_dense(cls, path, compiled):
    torch.manual_seed(0)
    model = cls()
    optimized = cc.optimize(model, budget=0.5, example_inputs=(X,), compile=False)
    report = str(cc.summary(optimized))
    assert f"capture: {path}" in report
    assert type(optimized.lin) is nn.Linear
    assert torch.equal(optimized.lin.weight, model.lin.weight)
    assert WHY in report.split("left dense")[1]
    assert isinstance(optimized.up, TensorizedLayer)  # the others are still tensorized
    with torch.no_grad():
        want = expected(model, optimized)
        run = torch.compile(optimized, backend="comera") if compiled else optimized
        got = run(X)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_reading_a_tensorized_weight_outside_a_captured_graph_raises(compiled):
    torch.manual_seed(0)
    optimized = cc.optimize(ReadsWeightUntraceable(), budget=0.5, compile=False)
    assert "capture: modules" in str(cc.summary(optimized))
    assert isinstance(optimized.lin, TensorizedLayer)  # no graph showed the read
    run = torch.compile(optimized, backend="comera") if compiled else optimized
    with pytest.raises(Exception, match=r"linear\(\) was called on the \.weight of a "
                                        r"tensorized layer.*Call the layer itself"):
        with torch.no_grad():
            run(X)


@pytest.mark.parametrize("layer", [cc.TTLinear(64, 32, ranks=4), cc.TTMLinear(64, 32, ranks=4),
                                   cc.TTEmbedding(64, 32, ranks=4)])
def test_a_tensorized_weight_answers_its_shape_and_dtype_and_refuses_arithmetic(layer):
    weight = layer.weight
    shape = (32, 64) if hasattr(layer, "in_features") else (64, 32)
    assert isinstance(weight, torch.Tensor)
    assert (weight.shape, weight.dtype, weight.dim(), weight.size(0)) == (
        torch.Size(shape), torch.float32, 2, shape[0])
    for compute in (lambda: F.linear(torch.randn(2, 64), weight),
                    lambda: F.embedding(torch.tensor([0]), weight),
                    lambda: weight + 1, lambda: weight.float(), lambda: weight.T):
        with pytest.raises(RuntimeError, match="has no dense weight"):
            compute()


class ReadsWeightShape(ReadsWeight):
    """Reads only the weight's description: a tensorized layer still answers it."""

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * (self.lin.weight.shape[0] / 64)


def test_a_forward_reading_only_the_weights_shape_keeps_the_layer_tensorized():
    torch.manual_seed(0)
    optimized = cc.optimize(ReadsWeightShape(), budget=0.5, compile=False)
    assert "capture: fx" in str(cc.summary(optimized))
    assert isinstance(optimized.lin, TensorizedLayer)
    with torch.no_grad():
        want = optimized.down(torch.relu(optimized.up(optimized.lin(X))))
        torch.testing.assert_close(optimized(X), want)


def test_capturing_by_export_leaves_no_graph_behind():
    """A model fx cannot trace is captured with ``torch.export``, which keeps its last graph
    (nodes, fake tensors, shape environment) in a module-level map: ``optimize`` empties it,
    so no fake tensor it made outlives the call."""
    import gc

    from torch._subclasses.fake_tensor import FakeTensor

    from tests.hf_models import llama

    def fakes() -> set[int]:  # compiled graphs of earlier tests may hold their own
        gc.collect()
        return {id(o) for o in gc.get_objects() if isinstance(o, FakeTensor)}

    build, inputs, _ = llama()
    before = fakes()
    model = cc.optimize(build(), budget=0.5, example_inputs=inputs, compile=False)
    assert "torch.export" in cc.summary(model).capture_reason
    assert not fakes() - before
