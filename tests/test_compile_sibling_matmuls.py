"""Thin products of one activation joined into one: same values and gradients, one matmul."""

import copy
import operator

import pytest
import torch
from torch import nn

from comera_compile.compile import compile_model
from comera_compile.compile.graph.sibling_matmuls import MAX_WIDTH, fuse_sibling_matmuls
from comera_compile.nn import CoLALinear, LowRankLinear


class SwiGLUAttentionInputs(nn.Module):
    """Q, K, V and gate / up as CoLA layers reading one normalised activation, a SwiGLU
    MLP and a product of two activations (never joined) beside them."""

    def __init__(self, width: int = 32, ranks=(6, 4, 4, 8, 8)) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.q, self.k, self.v, self.gate, self.up = (
            CoLALinear(width, width, ranks=r) for r in ranks)
        self.down = CoLALinear(width, width, ranks=5)

    def forward(self, x):
        h = self.norm(x)
        q, k, v = self.q(h), self.k(h), self.v(h)
        scores = (q @ k.transpose(-1, -2)).softmax(-1)  # activations: not a weight product
        mlp = self.down(nn.functional.silu(self.gate(h)) * self.up(h))
        return x + scores @ v + mlp


def _joining_backend(counts: list[int]):
    """A dynamo backend that runs the pass and then the graph as it is (no inductor)."""
    def backend(gm, example_inputs):
        counts.append(fuse_sibling_matmuls(gm))
        counts.append(sum(1 for n in gm.graph.nodes if n.op == "call_function"
                          and n.target in (operator.matmul, torch.matmul)))
        return gm.forward
    return backend


def _values_and_grads(model, x, proj):
    x = x.clone().requires_grad_(True)
    out = model(x)
    (out @ proj).square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out.detach(), x.grad, grads


def test_siblings_become_one_product_with_equal_values_and_gradients():
    torch.manual_seed(0)
    model = SwiGLUAttentionInputs()
    x, proj = torch.randn(3, 5, 32), torch.randn(32)
    want = _values_and_grads(model, x, proj)
    counts: list[int] = []
    compiled = torch.compile(copy.deepcopy(model), backend=_joining_backend(counts))
    got = _values_and_grads(compiled, x, proj)
    # q, k, v, gate and up all read h: four joined into the first
    assert counts[0] == 4
    # before: 6 first factors, 6 second factors, 2 attention products = 14 matmuls; after:
    # one joined product, down's first factor, 6 second factors, 2 attention products
    assert counts[1] == 10
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    for g, w in zip(got[2], want[2]):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
        assert w.abs().sum() > 0  # a random projection: every parameter has a gradient


def test_wide_or_activation_products_are_left_alone():
    torch.manual_seed(0)

    class Wide(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.randn(16, MAX_WIDTH + 8))
            self.b = nn.Parameter(torch.randn(16, MAX_WIDTH + 8))

        def forward(self, x):
            return x @ self.a + x @ self.b, x @ (x.transpose(-1, -2) @ x)[..., :8]

    counts: list[int] = []
    model = Wide()
    x = torch.randn(4, 16)
    out = torch.compile(model, backend=_joining_backend(counts))(x)
    assert counts[0] == 0
    torch.testing.assert_close(out, model(x))

    model.a.data, model.b.data = model.a[:, :8].clone(), model.b[:, :8].clone()
    counts.clear()
    torch._dynamo.reset()
    out = torch.compile(model, backend=_joining_backend(counts))(x)
    assert counts[0] == 1  # thin: a and b joined, the activation product left alone
    torch.testing.assert_close(out, model(x))


def test_comera_backend_joins_cola_siblings_and_can_be_turned_off():
    torch.manual_seed(0)
    model = SwiGLUAttentionInputs()
    x, proj = torch.randn(2, 4, 32), torch.randn(32)
    want = _values_and_grads(model, x, proj)
    from comera_compile.compile.graph import sibling_matmuls

    for join, joined in ((True, 4), (False, 0)):
        before = sibling_matmuls.products_joined()
        torch._dynamo.reset()
        compiled = compile_model(copy.deepcopy(model), inductor=False, join_products=join)
        got = _values_and_grads(compiled, x, proj)
        assert sibling_matmuls.products_joined() - before == joined
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        for g, w in zip(got[2], want[2]):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("join", [True, False])
def test_join_products_is_a_checked_option(join):
    from comera_compile.config import CompileOptions

    assert CompileOptions.from_backend_options({"join_products": join}).join_products is join
    assert CompileOptions(join_products=join).join_products is join
    with pytest.raises((TypeError, ValueError), match="join_products"):
        CompileOptions.from_backend_options({"join_products": "yes"})


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(SwiGLUAttentionInputs() for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_symbolic_ranks_join_and_survive_a_cut_without_a_new_graph():
    from comera_compile.compile.backend import graphs_compiled
    from comera_compile.compile.graph import sibling_matmuls

    torch.manual_seed(0)
    model = Blocks()
    joined = sibling_matmuls.products_joined()
    x, proj = torch.randn(2, 4, 32), torch.randn(32)
    torch._dynamo.reset()
    compiled = compile_model(copy.deepcopy(model), inplace=True, blocks=True,
                             symbolic_ranks=True, inductor=False)
    for step in range(2):
        if step == 1:  # a cut: two channels of one block's K and of another's gate off
            for m in (model, compiled):
                for layer in (m.blocks[0].k, m.blocks[2].gate):
                    with torch.no_grad():
                        layer.gates[0][:2] = 0.0
                    layer.prune_ranks()
            assert compiled.blocks[0].k.ranks[1] == 2 and compiled.blocks[2].gate.ranks[1] == 6
        before = graphs_compiled()
        want, got = _values_and_grads(model, x, proj), _values_and_grads(compiled, x, proj)
        if step == 1:
            assert graphs_compiled() == before  # the joined graph serves the cut ranks
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        for g, w in zip(got[2], want[2]):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    assert sibling_matmuls.products_joined() - joined == 4  # one graph serves the 3 blocks


class LowRankSiblings(nn.Module):
    """Q, K and V as low-rank layers (one planned contraction each) reading one
    normalised activation, and a fourth low-rank layer reading another."""

    def __init__(self, width: int = 48, ranks=(6, 4, 4), out_rank: int = 5) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.q, self.k, self.v = (LowRankLinear(width, width, ranks=r) for r in ranks)
        self.out = LowRankLinear(width, width, ranks=out_rank)

    def forward(self, x):
        h = self.norm(x)
        return x + self.out(self.q(h) + self.k(h) * self.v(h))


def _graph_counting_backend(counts: list[tuple[int, int, int]]):
    """Runs the pass, then records (joined, matmuls, planned contractions) and runs the
    graph as it is."""
    from comera_compile.planner.ops import CONTRACT

    def backend(gm, example_inputs):
        joined = fuse_sibling_matmuls(gm)
        calls = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        counts.append((joined, sum(t in (operator.matmul, torch.matmul) for t in calls),
                       sum(t is CONTRACT for t in calls)))
        return gm.forward
    return backend


def test_lowrank_siblings_are_written_out_and_joined_with_equal_values_and_gradients():
    torch.manual_seed(0)
    model = LowRankSiblings()
    x, proj = torch.randn(3, 50, 48), torch.randn(48)
    want = _values_and_grads(model, x, proj)
    counts: list[tuple[int, int, int]] = []
    got = _values_and_grads(torch.compile(copy.deepcopy(model),
                                          backend=_graph_counting_backend(counts)), x, proj)
    # q, k, v: one joined x @ [U_q | U_k | U_v] and three second factors; out (no sibling)
    # stays one planned contraction
    assert counts == [(2, 4, 1)]
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    for g, w in zip(got[2], want[2]):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
        assert w.abs().sum() > 0


def test_lowrank_siblings_stay_planned_where_the_plan_would_not_start_from_x():
    torch.manual_seed(0)
    # rank 30 at width 48: x @ U @ V costs more per row than the dense product (30 * 96 >
    # 48 * 48), so over many rows the plan builds U @ V first; nothing to join
    model = LowRankSiblings(ranks=(30, 30, 30))
    x = torch.randn(4, 64, 48)
    counts: list[tuple[int, int, int]] = []
    out = torch.compile(model, backend=_graph_counting_backend(counts))(x)
    assert counts == [(0, 0, 4)]
    torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)


def test_lowrank_siblings_with_symbolic_ranks_survive_a_cut_without_a_new_graph():
    from comera_compile.compile.backend import graphs_compiled
    from comera_compile.compile.graph import sibling_matmuls

    torch.manual_seed(0)
    model = nn.Sequential(LowRankSiblings(), LowRankSiblings())
    x, proj = torch.randn(2, 40, 48), torch.randn(48)
    joined = sibling_matmuls.products_joined()
    torch._dynamo.reset()
    compiled = compile_model(copy.deepcopy(model), inplace=True, blocks=True,
                             symbolic_ranks=True, inductor=False)
    for step in range(2):
        if step == 1:  # a cut: two channels of the first block's K off
            for m in (model, compiled):
                with torch.no_grad():
                    m[0].k.gates[0][:2] = 0.0
                m[0].k.prune_ranks()
            assert compiled[0].k.rank == 2
        before = graphs_compiled()
        want, got = _values_and_grads(model, x, proj), _values_and_grads(compiled, x, proj)
        if step == 1:
            assert graphs_compiled() == before
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        for g, w in zip(got[2], want[2]):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    assert sibling_matmuls.products_joined() - joined == 2  # one graph serves both blocks
