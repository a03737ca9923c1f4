"""Bond-thin matmuls in the orientation timed faster (compile.matmul_orientation)."""

import pytest
import torch
from models import assert_compiled_gradients_match_eager
from torch.fx.experimental.proxy_tensor import make_fx

import comera_compile.compile.matmul_orientation as orientation
from comera_compile.nn import CoLALinear, LowRankLinear, TTLinear

aten = torch.ops.aten


def _traced(fn, *args):
    return make_fx(fn, tracing_mode="fake")(*args)


def _mm_shapes(gm):
    return [tuple(n.meta["val"].shape) for n in gm.graph.nodes if n.target is aten.mm.default]


@pytest.fixture
def timings(monkeypatch):
    """Replace the timing with given (written, turned) seconds; record what was timed."""
    asked, answer = [], {"seconds": (2.0, 1.0)}

    def fake_timing(*layout):
        asked.append(layout)
        return answer["seconds"]

    monkeypatch.setattr(orientation, "_choices", {})
    monkeypatch.setattr(orientation, "time_both_forms", fake_timing)
    return asked, answer


@pytest.mark.parametrize("fn, a, b", [
    (lambda a, b: a @ b, torch.randn(1024, 384), torch.randn(384, 9)),  # x @ U
    (lambda a, b: a.t() @ b, torch.randn(1024, 384), torch.randn(1024, 9)),  # dU = x.T @ dh
    (lambda a, b: a.t() @ b, torch.randn(1024, 14), torch.randn(1024, 768)),  # dV = h.T @ dy
    (lambda a, b: a @ b.t(), torch.randn(1024, 9), torch.randn(384, 9)),  # dx = dh @ U.T
])
def test_a_matmul_timed_faster_turned_is_rewritten_with_the_same_values(timings, fn, a, b):
    asked, _ = timings
    gm = _traced(fn, a, b)
    expected_shape = tuple(fn(a, b).shape)
    assert orientation.orient_thin_matmuls(gm.graph) == 1
    gm.recompile()
    assert _mm_shapes(gm) == [expected_shape[::-1]]  # the transposed problem
    assert len(asked) == 1
    out = gm(a, b)
    assert out.shape == expected_shape
    torch.testing.assert_close(out, fn(a, b), rtol=1e-5, atol=1e-4)  # summation order


def test_the_turned_form_must_win_by_the_margin_and_each_layout_is_timed_once(timings):
    asked, answer = timings
    layout = ((1024, 384), (384, 1), (384, 9), (9, 1), torch.float32)
    answer["seconds"] = (1.1, 1.0)  # under MIN_GAIN: noise, not a win
    assert not orientation.faster_turned(*layout)
    answer["seconds"] = (3.0, 1.0)
    assert not orientation.faster_turned(*layout)  # remembered, not timed again
    assert len(asked) == 1
    assert orientation.faster_turned(*layout[:4], torch.float64)  # another dtype: timed
    assert len(asked) == 2


@pytest.mark.parametrize("fn, a, b", [
    (lambda a, b: a @ b, torch.randn(1024, 384), torch.randn(384, 96)),  # no side a bond
    (lambda a, b: a @ b, torch.randint(0, 9, (1024, 384)), torch.randint(0, 9, (384, 9))),
    (lambda a, b: a @ b, torch.randn(1024, 384), torch.randn(1, 9).expand(384, 9)),  # broadcast
    (lambda a, b: a @ b, torch.randn(1024, 384), torch.randn(768, 9)[::2]),  # rows strided
])
def test_matmuls_that_are_not_bond_thin_and_dense_are_not_timed(timings, fn, a, b):
    asked, _ = timings
    gm = _traced(fn, a, b)
    assert orientation.orient_thin_matmuls(gm.graph) == 0
    assert asked == []


def test_deterministic_algorithms_keep_every_matmul_as_written(timings):
    asked, _ = timings
    gm = _traced(lambda a, b: a @ b, torch.randn(1024, 384), torch.randn(384, 9))
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert orientation.orient_thin_matmuls(gm.graph) == 0
    finally:
        torch.use_deterministic_algorithms(deterministic)
    assert asked == [] and orientation.orient_thin_matmuls(gm.graph) == 1


def test_a_matmul_timed_slower_turned_is_left_as_written(timings):
    asked, answer = timings
    answer["seconds"] = (1.0, 4.0)
    gm = _traced(lambda a, b: a.t() @ b, torch.randn(1024, 9), torch.randn(1024, 384))
    assert orientation.orient_thin_matmuls(gm.graph) == 0
    assert len(asked) == 1


def test_timing_both_forms_measures_real_kernels():
    # x.T @ dh for a factor of bond 9: BLAS runs it below its transposed problem (4x on
    # the two Zen 3 cores this was written on); both forms take real, finite time
    written, turned = orientation.time_both_forms((384, 4096), (1, 384), (4096, 9), (9, 1))
    assert 0 < turned < written < 1.0


@pytest.mark.parametrize("layer", [
    lambda: TTLinear(64, 512, ranks=8),
    lambda: LowRankLinear(256, 384, ranks=9),
    lambda: CoLALinear(256, 384, ranks=12),
])
def test_compiled_training_with_every_timed_matmul_turned_matches_eager(timings, layer):
    asked, _ = timings  # each timed matmul is "faster turned": forward and backward rewritten
    torch.manual_seed(0)
    first = layer()
    model = torch.nn.Sequential(first, torch.nn.GELU(), torch.nn.Linear(first.out_features, 8))
    assert_compiled_gradients_match_eager(model, torch.randn(512, first.in_features))
    assert len(asked) >= 3  # the layer's forward and both factors' gradients at least
