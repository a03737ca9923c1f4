"""On CPU the compiled forward keeps no comparison mask for backward (inductor's CPU kernels
store booleans slowly): a ReLU's mask is remade in backward, and gradients stay exact."""

import pytest
import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from comera_compile.compile.graph import recompute

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compiled_relu_encoder_keeps_no_boolean_and_matches_eager_gradients():
    """torch's own encoder layer (ReLU, no dropout), its FFN compressed: without the rule
    the forward keeps the 4 x 16 x 256 ReLU mask as booleans."""
    import comera_compile as cc

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0, batch_first=True)
    dense = torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
    x = torch.randn(4, 16, 64)
    model = cc.optimize(dense, budget=0.3, example_inputs=(x,), compile=False)
    assert cc.nn.tensorized_layers(model)
    proj = torch.randn(64, 8)
    saved = []

    def pack(t):
        saved.append(t.dtype)
        return t

    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = torch.compile(model, backend="comera")(x)
    (out @ proj).square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    eager = model(x)
    (eager @ proj).square().mean().backward()
    assert saved and torch.bool not in saved
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, (p.grad for p in model.parameters())):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def joint_relu_graph(backward_reads_output: bool) -> tuple[fx.Graph, fx.Node]:
    """``out = relu(x); mask = out <= 0`` read by a tangent's ``where``; backward also
    reads ``out`` (a weight gradient's matmul) or not."""
    graph = fx.Graph()
    x, tangent = graph.placeholder("x"), graph.placeholder("tangents_1")
    for node in (x, tangent):
        node.meta["val"] = torch.empty(1024, 1024, device="meta")
    out = graph.call_function(aten.relu.default, (x,))
    mask = graph.call_function(aten.le.Scalar, (out, 0))
    grad = graph.call_function(aten.where.self, (mask, tangent, tangent))
    out.meta["val"] = grad.meta["val"] = torch.empty(1024, 1024, device="meta")
    mask.meta["val"] = torch.empty(1024, 1024, dtype=torch.bool, device="meta")
    results = [grad]
    if backward_reads_output:
        weight_grad = graph.call_function(aten.mm.default, (tangent, out))
        weight_grad.meta["val"] = torch.empty(1024, 1024, device="meta")
        results.append(weight_grad)
    graph.output(tuple(results))
    return graph, mask


@pytest.mark.parametrize("backward_reads_output", [True, False])
def test_masks_are_remade_and_low_memory_remakes_only_those_that_cost_nothing(
        backward_reads_output):
    graph, mask = joint_relu_graph(backward_reads_output)
    assert recompute.recompute_masks(graph, keep_memory=True) == int(backward_reads_output)
    graph, mask = joint_relu_graph(backward_reads_output)
    assert recompute.recompute_masks(graph) == 1
    assert mask.meta["recompute"] == CheckpointPolicy.MUST_RECOMPUTE


def test_random_masks_keep_their_marking():
    graph, mask = joint_relu_graph(True)
    mask.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    assert recompute.recompute_masks(graph) == 0
    assert mask.meta["recompute"] == CheckpointPolicy.MUST_SAVE
