"""Bond padding on CPU: ranks the matmul kernels like, with results and gradients exact."""

import pytest
import torch

import comera_compile.planner.alignment as alignment
from comera_compile.nn import TTLinear, TTMLinear
from comera_compile.planner.alignment import aligned_rank, bond_padding, is_static, pad_bonds


def test_near_misses_are_padded_and_nothing_else():
    padded = {r: aligned_rank(r) for r in (7, 12, 15, 28, 29, 30, 31, 32, 36, 46, 58, 64, 100)}
    assert padded == {7: 7, 12: 12, 15: 16, 28: 28, 29: 32, 30: 32, 31: 32, 32: 32, 36: 36,
                      46: 48, 58: 64, 64: 64, 100: 100}
    assert aligned_rank(30, "cuda") == 30  # not measured there: left alone


def test_pad_bonds_zero_pads_both_sides_of_each_bond_only_for_many_rows():
    cores = [torch.randn(1, 4, 30), torch.randn(30, 5, 46), torch.randn(46, 6, 1)]
    out = pad_bonds(cores, rows=4096)
    assert [tuple(c.shape) for c in out] == [(1, 4, 32), (32, 5, 48), (48, 6, 1)]
    assert not out[0][..., 30:].any() and not out[1][30:].any() and not out[1][..., 46:].any()
    torch.testing.assert_close(out[1][:30, :, :46], cores[1])
    assert pad_bonds(cores, rows=512) == cores  # few rows: the matmuls are small


@pytest.mark.parametrize("cls", [TTLinear, TTMLinear])
def test_padded_layer_matches_its_dense_weight_in_outputs_and_gradients(cls, monkeypatch):
    torch.manual_seed(0)
    layer = cls(256, 256, ranks=30)
    assert 30 in layer.ranks
    assert any(c.shape[0] == 32 for c in layer.network_cores(1024)[1:])
    x = torch.randn(1024, 256)
    y = layer(x)
    dense = x @ layer.to_dense().T + layer.bias
    torch.testing.assert_close(y, dense, rtol=1e-4, atol=1e-4)
    y.square().sum().backward()
    padded = [c.grad.clone() for c in layer.cores]
    layer.zero_grad()
    monkeypatch.setattr(alignment, "MIN_ROWS", 10**9)  # the same step, unpadded
    layer(x).square().sum().backward()
    for got, want in zip(padded, (c.grad for c in layer.cores)):
        scale = want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4 * scale)


def test_cola_layer_pads_its_bond_and_gate_exactly(monkeypatch):
    import comera_compile.nn.cola_linear as cola_linear
    from comera_compile.nn import CoLALinear

    torch.manual_seed(0)
    layer = CoLALinear(128, 192, ranks=30)
    with torch.no_grad():
        layer.gates[0][:3] = 0.0  # gated-off channels stay off in the padded bond
    seen = []
    monkeypatch.setattr(cola_linear, "bond_padding",
                        lambda cores, rows: seen.append(bond_padding(cores, rows)) or seen[-1])
    x, proj = torch.randn(4, 300, 128), torch.randn(192)
    y = layer(x)
    assert seen[-1] == [2]  # 1200 rows: rank 30 runs at 32
    u, v = layer.cores[0].reshape(128, 30), layer.cores[1].reshape(30, 192)
    gate = torch.nn.functional.hardshrink(layer.gates[0], layer.threshold)
    want = (torch.nn.functional.silu(x @ u) * gate) @ v + layer.bias
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    (y @ proj).square().mean().backward()
    padded = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    monkeypatch.setattr(alignment, "MIN_ROWS", 10**9)  # the same step, unpadded
    y = layer(x)
    assert seen[-1] == [0]
    (y @ proj).square().mean().backward()
    for got, want in zip(padded, (p.grad for p in layer.parameters())):
        assert got.shape == want.shape and want.abs().sum() > 0
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_symbolic_bonds_are_left_alone_without_a_guard():
    """While dynamo traces, a symbolic rank looks like an int; padding it would guard the
    graph to the rank's residue mod 16, and a rank cut would compile it again."""
    compiles = []

    def backend(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    def padded_sizes(left, right):
        out = pad_bonds([left, right], 4096)
        return out[0].sum(-1) * 0 + out[0].shape[-1] * is_static(left.shape[-1])

    compiled = torch.compile(padded_sizes, backend=backend, fullgraph=True)
    for rank in (30, 47, 64, 70, 15):  # near misses, a multiple, wide: every padding case
        left, right = torch.randn(1, 4, rank), torch.randn(rank, 5, 1)
        torch._dynamo.maybe_mark_dynamic(left, 2)
        torch._dynamo.maybe_mark_dynamic(right, 0)
        assert compiled(left, right).eq(0).all()  # symbolic: not static, not padded
    assert len(compiles) == 1
    assert is_static(30) and bond_padding([torch.randn(1, 4, 30), torch.randn(30, 5, 1)],
                                          4096) == [2]


def test_compiled_cola_blocks_with_symbolic_ranks_cut_across_paddings_without_a_new_graph():
    import copy

    from torch import nn

    from comera_compile.compile import compile_model
    from comera_compile.compile.backend import graphs_compiled
    from comera_compile.nn import CoLALinear

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = CoLALinear(64, 96, ranks=30), CoLALinear(96, 64, ranks=47)

        def forward(self, x):
            return x + self.down(self.up(x))

    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    compiled = compile_model(copy.deepcopy(model), inplace=True, blocks=True,
                             symbolic_ranks=True, inductor=False)
    x, proj = torch.randn(3, 200, 64), torch.randn(64)  # 600 rows: eager pads 30 and 47
    for cut in (0, 2, 14):  # 30 -> 28 -> 14 and 47 -> 45 -> 31: in and out of padding
        for m in (model, compiled):
            for layer in (m[0].up, m[1].down):
                with torch.no_grad():
                    layer.gates[0][:cut] = 0.0
                layer.prune_ranks()
        before = graphs_compiled()
        want, got = model(x), compiled(x)
        if cut:
            assert graphs_compiled() == before  # one graph for every rank
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        (got @ proj).square().mean().backward()
        (want @ proj).square().mean().backward()
        for a, b in zip(compiled.parameters(), model.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6)
        compiled.zero_grad(), model.zero_grad()
