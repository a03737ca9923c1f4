"""Thin weight-gradient matmuls as their transposed problem (compile.cpu.matmul_orientation)."""

import pytest
import torch
from models import assert_compiled_gradients_match_eager
from torch.fx.experimental.proxy_tensor import make_fx

import comera_compile.compile.cpu.matmul_orientation as orientation
from comera_compile.nn import TTLinear

aten = torch.ops.aten


def _traced(fn, *args):
    return make_fx(fn, tracing_mode="fake")(*args)


def _mm_shapes(gm):
    return [tuple(n.meta["val"].shape) for n in gm.graph.nodes if n.target is aten.mm.default]


@pytest.mark.parametrize("m, k, n", [(32, 2048, 256), (48, 2048, 768), (64, 4096, 300)])
def test_thin_weight_gradient_is_computed_transposed_with_the_same_values(m, k, n):
    h, dy = torch.randn(k, m), torch.randn(k, n)  # float32: the only dtype it turns
    gm = _traced(lambda a, b: a.t() @ b, h, dy)
    assert orientation.orient_thin_matmuls(gm.graph) == 1
    gm.recompile()
    assert _mm_shapes(gm) == [(n, m)]  # the wide side now gives the rows
    out = gm(h, dy)
    assert out.shape == (m, n)
    torch.testing.assert_close(out, h.t() @ dy, rtol=1e-5, atol=1e-4)  # summation order


@pytest.mark.parametrize(
    "fn, a, b",
    [
        (lambda a, b: a @ b, torch.randn(32, 2048), torch.randn(2048, 768)),  # not transposed
        (lambda a, b: a.t() @ b, torch.randn(1024, 32), torch.randn(1024, 768)),  # short reduction
        (lambda a, b: a.t() @ b, torch.randn(2048, 14), torch.randn(2048, 768)),  # too thin
        (lambda a, b: a.t() @ b, torch.randn(2048, 128), torch.randn(2048, 768)),  # not thin
        (lambda a, b: a.t() @ b, torch.randn(2048, 32), torch.randn(2048, 64)),  # not wide
        (lambda a, b: a.t() @ b, torch.randn(2048, 32), torch.randn(2048, 3072)),  # too wide
        (lambda a, b: a.t() @ b.t(), torch.randn(2048, 32), torch.randn(768, 2048)),  # b.T
        (lambda a, b: a.t() @ b, torch.randint(0, 9, (2048, 32)), torch.randint(0, 9, (2048, 768))),
        (lambda a, b: a.t() @ b, torch.randn(2048, 32, dtype=torch.float64),
         torch.randn(2048, 768, dtype=torch.float64)),  # dgemm runs it faster as written
    ],
)
def test_other_matmuls_are_left_alone(fn, a, b):
    gm = _traced(fn, a, b)
    assert orientation.orient_thin_matmuls(gm.graph) == 0


def test_compiled_cpu_training_turns_tt_weight_gradients_and_matches_eager(monkeypatch):
    calls = []
    original = orientation.orient_thin_matmuls
    monkeypatch.setattr(orientation, "orient_thin_matmuls",
                        lambda graph: calls.append(original(graph)) or calls[-1])
    torch.manual_seed(0)
    model = torch.nn.Sequential(TTLinear(64, 512, ranks=32), torch.nn.GELU(),
                                TTLinear(512, 256, ranks=32))
    assert_compiled_gradients_match_eager(model, torch.randn(2048, 64))
    assert sum(calls) >= 1  # the 32 x 2048 x 512 gradient of the first layer's output factor
