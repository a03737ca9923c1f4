"""Row sums split into blocks of rows in CPU graphs (compile.cpu.reductions)."""

import pytest
import torch
from models import assert_compiled_gradients_match_eager
from torch.fx.experimental.proxy_tensor import make_fx

import comera_compile.compile.cpu.reductions as reductions
from comera_compile.nn import TTLinear

aten = torch.ops.aten


def _sums(gm):
    return [n for n in gm.graph.nodes if n.target is aten.sum.dim_IntList]


def _traced(fn, *args):
    return make_fx(fn, tracing_mode="fake")(*args)


@pytest.mark.parametrize(
    "shape, dims, keepdim",
    [((2048, 48), [0], False), ((16, 128, 24), [0, 1], False), ((4096, 8), [0], True)],
)
def test_row_sums_become_block_sums_with_the_same_values(shape, dims, keepdim):
    x = torch.randn(shape, dtype=torch.float64)
    gm = _traced(lambda t: (t * 2).sum(dims, keepdim=keepdim), x)
    assert reductions.split_row_sums(gm.graph) == 1
    gm.recompile()
    sums = _sums(gm)
    assert [n.args[1] for n in sums] == [[1], [0]]  # within blocks, then over blocks
    rows = 1
    for d in dims:
        rows *= shape[d]
    assert list(sums[0].args[0].meta["val"].shape)[:2] == [rows // 64, 64]
    expected = (x * 2).sum(dims, keepdim=keepdim)
    out = gm(x)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "fn, x",
    [
        (lambda t: t.sum([0]), torch.randn(512, 64)),  # few rows: the one-pass loop is fine
        (lambda t: t.sum([1]), torch.randn(4096, 64)),  # a sum along rows, not over them
        (lambda t: t.sum([0, 1]), torch.randn(4096, 64)),  # everything: a scalar
        (lambda t: t.t().sum([0]), torch.randn(64, 4096)),  # not contiguous
        (lambda t: t.sum([0]), torch.randint(0, 9, (4096, 8))),  # integers
        (lambda t: t.sum([0]), torch.randn(4096, 8, dtype=torch.bfloat16)),  # bf16 partials
        (lambda t: t.sum([0]), torch.randn(1030, 8)),  # no block of 16, 32 or 64 divides
    ],
)
def test_other_sums_are_left_alone(fn, x):
    gm = _traced(fn, x)
    assert reductions.split_row_sums(gm.graph) == 0


def test_compiled_cpu_training_splits_bias_gradients_and_matches_eager(monkeypatch):
    calls = []
    original = reductions.split_row_sums
    monkeypatch.setattr(reductions, "split_row_sums",
                        lambda graph, *a: calls.append(original(graph, *a)) or calls[-1])
    torch.manual_seed(0)
    model = torch.nn.Sequential(TTLinear(64, 96, ranks=4), torch.nn.GELU(),
                                torch.nn.LayerNorm(96), TTLinear(96, 32, ranks=4))
    assert_compiled_gradients_match_eager(model, torch.randn(2048, 64))
    assert sum(calls) >= 3  # two TT biases and the LayerNorm's weight and bias
