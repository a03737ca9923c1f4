"""TTLinear / TTMLinear / TTEmbedding: exactness against their dense form, gradients, gates,
pruning and state dicts."""

import io
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from comera_compile.formats import chain_layout
from comera_compile.nn import LayoutMismatchError, LowRankLinear, TTEmbedding, TTLinear, TTMLinear

torch.manual_seed(0)

LINEAR_KINDS = [TTLinear, TTMLinear]


def random_gates(layer, low=0.5, high=1.5):
    with torch.no_grad():
        for g in layer.gates:
            g.uniform_(low, high)


def independent_weight(layer) -> torch.Tensor:
    """The ``(out, in)`` weight from the cores and gates by the layer's definition, written
    here without the layer's own code (no gate folding, hardshrink or to_dense): the chain
    contracted bond by bond, each bond scaled by its gate with entries ``|g| <= threshold``
    off. TT cores run over the input modes, then the output modes; TTM cores pair an output
    mode with an input mode."""
    cores, gates = [c.detach() for c in layer.cores], [g.detach() for g in layer.gates]
    chain = cores[0][0]
    for gate, core in zip(gates, cores[1:]):
        on = torch.where(gate.abs() > layer.threshold, gate, torch.zeros_like(gate))
        chain = torch.tensordot(chain * on, core, dims=([chain.dim() - 1], [0]))
    chain = chain[..., 0]
    if isinstance(layer, TTMLinear):  # (o1, i1, o2, i2, ...) -> (o1, o2, ..., i1, i2, ...)
        d = chain.dim() // 2
        chain = chain.permute(*range(0, 2 * d, 2), *range(1, 2 * d, 2))
        full = chain.reshape(math.prod(chain.shape[:d]), -1)
        return full[: layer.out_features, : layer.in_features]
    d = len(layer.in_modes)
    full = chain.reshape(math.prod(chain.shape[:d]), -1)  # (padded in, padded out)
    return full[: layer.in_features, : layer.out_features].T


@pytest.mark.parametrize("cls", LINEAR_KINDS)
@pytest.mark.parametrize("shape", [(24, 20), (768, 768), (13, 7)])
def test_forward_equals_dense(cls, shape):
    layer = cls(*shape, ranks=5).double()
    random_gates(layer)
    with torch.no_grad():  # channels off below and exactly at the threshold
        for gate in layer.gates:
            gate[0] = 0.5 * layer.threshold
            gate[-1] = -layer.threshold
    x = torch.randn(3, 5, shape[0], dtype=torch.float64)
    expected = x @ independent_weight(layer).T + layer.bias
    torch.testing.assert_close(layer(x), expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(layer.forward_fixed_order(x), expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(layer.to_dense(), independent_weight(layer), rtol=1e-10,
                               atol=1e-10)


@pytest.mark.parametrize("cls", LINEAR_KINDS)
def test_a_gate_exactly_at_the_threshold_is_off(cls):
    """The boundary: ``|g| <= threshold`` is off in the forward, so it is dead for the rank
    count and for pruning too."""
    layer = cls(24, 20, ranks=4, threshold=0.25).double()
    random_gates(layer)
    with torch.no_grad():
        layer.gates[0][1] = 0.25  # exactly representable: exactly at the threshold
        layer.gates[0][2] = -0.25
    ranks = layer.ranks
    assert layer.effective_ranks()[1] == ranks[1] - 2
    x = torch.randn(4, 24, dtype=torch.float64)
    before = layer(x)
    result = layer.prune_ranks()
    assert layer.ranks[1] == ranks[1] - 2 and result.total_removed > 0
    torch.testing.assert_close(layer(x), before, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cls", LINEAR_KINDS)
def test_a_non_default_threshold_survives_a_state_dict_round_trip(cls):
    torch.manual_seed(0)
    layer = cls(24, 20, ranks=4, threshold=0.3).double()
    random_gates(layer, 0.1, 1.0)  # some gates between the default threshold and 0.3
    with torch.no_grad():
        layer.gates[0][0] = 0.2  # at least one, whatever the draw
    fresh = cls(24, 20, ranks=4).double()
    assert fresh.threshold != 0.3
    fresh.load_state_dict(layer.state_dict())
    assert fresh.threshold == 0.3
    assert fresh.effective_ranks() == layer.effective_ranks() != layer.ranks
    x = torch.randn(4, 24, dtype=torch.float64)
    assert torch.equal(fresh(x), layer(x))


@pytest.mark.parametrize("cls", LINEAR_KINDS)
def test_from_dense_full_rank_is_exact(cls):
    dense = nn.Linear(12, 10).double()
    layer = cls.from_dense(dense)
    torch.testing.assert_close(layer.to_dense(), dense.weight, rtol=1e-9, atol=1e-9)
    x = torch.randn(4, 12, dtype=torch.float64)
    torch.testing.assert_close(layer(x), dense(x), rtol=1e-9, atol=1e-9)


def _gradcheck_module(layer, *inputs):
    names = [n for n, _ in layer.named_parameters()]
    params = [p.detach().clone().requires_grad_(True) for p in layer.parameters()]

    def fn(*tensors):
        n = len(inputs)
        return functional_call(layer, dict(zip(names, tensors[n:])), tensors[:n])

    assert torch.autograd.gradcheck(fn, (*inputs, *params), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("cls", LINEAR_KINDS)
def test_gradcheck_linear(cls):
    layer = cls(12, 6, ranks=3, in_modes=[3, 4], out_modes=[2, 3]).double()
    random_gates(layer)
    x = torch.randn(3, 12, dtype=torch.float64, requires_grad=True)
    _gradcheck_module(layer, x)


@pytest.mark.parametrize("mode", [None, "sum", "mean"])
def test_gradcheck_embedding(mode):
    layer = TTEmbedding(20, 6, ranks=3, row_modes=[4, 5], col_modes=[2, 3], mode=mode).double()
    random_gates(layer)
    ids = torch.tensor([[1, 7, 7], [19, 0, 3]])
    _gradcheck_module(layer, ids)


@pytest.mark.parametrize("dedup", [True, False])
@pytest.mark.parametrize("padding_idx", [None, 3])
def test_embedding_rows_match_table(dedup, padding_idx):
    layer = TTEmbedding(1000, 24, ranks=6, dedup=dedup, padding_idx=padding_idx).double()
    random_gates(layer)
    table = layer.to_dense()
    ids = torch.randint(0, 1000, (7, 9))
    ids[0, :4] = 3  # repeats (and padding when padding_idx == 3)
    torch.testing.assert_close(layer(ids), table[ids], rtol=1e-10, atol=1e-10)
    if padding_idx is not None:  # padding reads zeros and trains nothing
        rows = layer(torch.tensor([3, 3]))
        assert rows.abs().max() == 0
        rows.sum().backward()
        assert all(p.grad is None or p.grad.abs().max() == 0 for p in layer.parameters())


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("dedup", [True, False])
@pytest.mark.parametrize("last", [False, True])
def test_bags_by_offsets_pool_as_embedding_bag_does_with_the_same_gradients(mode, dedup, last):
    """Bags of several ids, empty ones and one id each, ``include_last_offset`` or not: the
    bags and the cores' gradients equal ``F.embedding_bag`` on the dense table's."""
    torch.manual_seed(0)
    layer = TTEmbedding(500, 16, ranks=5, mode=mode, dedup=dedup,
                        include_last_offset=last).double()
    random_gates(layer)
    ids = torch.tensor([4, 2, 4, 9, 499, 0, 2, 7])
    for offsets in (torch.tensor([0, 3, 3, 6]), torch.arange(8)):
        if last:
            offsets = torch.cat([offsets, torch.tensor([8])])
        table = layer.to_dense()
        want = F.embedding_bag(ids, table, offsets, mode=mode, include_last_offset=last)
        got = layer(ids, offsets)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        weight = torch.randn_like(got)
        grads = torch.autograd.grad((got * weight).sum(), list(layer.cores))
        wanted = torch.autograd.grad((F.embedding_bag(ids, layer.to_dense(), offsets, mode=mode,
                                                      include_last_offset=last) * weight).sum(),
                                     list(layer.cores))
        for a, b in zip(grads, wanted):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("last", [False, True])
def test_crafted_offsets_pool_as_embedding_bag_does_or_are_refused_as_it_refuses(last):
    """Offsets that fall, start past 0, run past the ids or end short: the bags equal
    ``F.embedding_bag``'s where it takes the offsets, and an error where it refuses them,
    never a pooling past the ids (a falling run once wrote past a buffer's end)."""
    torch.manual_seed(0)
    layer = TTEmbedding(500, 16, ranks=5, mode="mean", include_last_offset=last)
    ids = torch.tensor([4, 2, 4, 9, 499, 0, 2, 7])
    g = torch.Generator().manual_seed(1)
    crafted = [[0, 3, 3, 12], [0, 3, 2, 6], [0, 3, 9], [0, -1, 5], [2, 3], [0, 0, 0],
               [0, 3, 6, 7], [0, 3, 3, 8]]
    crafted += [torch.randint(-2, 11, (4,), generator=g).tolist() for _ in range(30)]
    for offsets in map(torch.tensor, crafted):
        try:
            want = F.embedding_bag(ids, layer.to_dense(), offsets, mode="mean",
                                   include_last_offset=last)
        except (RuntimeError, IndexError, ValueError):
            with pytest.raises((RuntimeError, IndexError, ValueError)):
                layer(ids, offsets)
            continue
        torch.testing.assert_close(layer(ids, offsets), want, rtol=1e-5, atol=1e-6)


def test_a_lookup_dedups_ids_only_where_a_row_is_costly_and_both_give_the_same_bags():
    """Rank 5 of dim 16 (80 multiply-adds a row): each id's row is built; rank 40 (640):
    each distinct row once. Either way the bags and the gradients are those of the other."""
    for rank, dedups in ((5, False), (40, True)):
        torch.manual_seed(0)
        auto = TTEmbedding(20000, 16, ranks=rank, row_modes=[200, 100], col_modes=[1, 16],
                           mode="sum", sparse=True).double()
        assert auto.dedups is dedups
        other = TTEmbedding(20000, 16, ranks=rank, row_modes=[200, 100], col_modes=[1, 16],
                            mode="sum", sparse=True, dedup=not dedups).double()
        other.load_state_dict(auto.state_dict())
        random_gates(auto)
        other.load_state_dict(auto.state_dict())
        bags = torch.randint(0, 300, (64, 3))  # many repeats
        weight = torch.randn(64, 16, dtype=torch.float64)
        outs = [layer(bags) for layer in (auto, other)]
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-12, atol=1e-12)
        for out in outs:
            (out * weight).sum().backward()
        for a, b in zip(auto.parameters(), other.parameters()):
            grads = [g.to_dense() if g.is_sparse else g for g in (a.grad, b.grad)]
            torch.testing.assert_close(*grads, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("dedup", [True, False])
def test_embedding_bag_matches_dense_bag(mode, dedup):
    layer = TTEmbedding(500, 16, ranks=5, mode=mode, dedup=dedup, padding_idx=2).double()
    random_gates(layer)
    ids = torch.tensor([4, 2, 4, 9, 499, 0, 2, 7])
    offsets = torch.tensor([0, 3, 3, 6])  # one empty bag
    expected = F.embedding_bag(ids, layer.to_dense(), offsets, mode=mode, padding_idx=2)
    torch.testing.assert_close(layer(ids, offsets), expected, rtol=1e-10, atol=1e-10)
    bags = ids.reshape(2, 4)
    expected2 = F.embedding_bag(bags, layer.to_dense(), mode=mode, padding_idx=2)
    torch.testing.assert_close(layer(bags), expected2, rtol=1e-10, atol=1e-10)


def test_embedding_rejects_bad_ids():
    layer = TTEmbedding(100, 8, ranks=4)
    with pytest.raises(IndexError, match=r"\[0, 100\)"):
        layer(torch.tensor([5, 100]))
    with pytest.raises(TypeError, match="integer ids"):
        layer(torch.tensor([1.0]))


@pytest.mark.parametrize(
    "make",
    [
        lambda: TTLinear(64, 48, ranks=6),
        lambda: TTMLinear(64, 48, ranks=6, order=3),
        lambda: TTEmbedding(300, 16, ranks=6, order=3),
    ],
)
def test_prune_keeps_outputs_and_cuts_exact_count(make):
    layer = make().double()
    random_gates(layer)
    x = (
        torch.randint(0, 300, (10,))
        if isinstance(layer, TTEmbedding)
        else torch.randn(5, 64).double()
    )
    assert len(layer.gates) >= 2
    dead = {0: [1, 4], len(layer.gates) - 1: [0]}
    with torch.no_grad():
        for bond, channels in dead.items():
            layer.gates[bond][channels] = 0.005  # below the 0.01 threshold
    before_out = layer(x)
    ranks = layer.ranks
    expected_ranks = list(ranks)
    for bond, channels in dead.items():
        expected_ranks[bond + 1] -= len(channels)
    expected_params = layer.num_core_parameters(expected_ranks)
    assert layer.effective_ranks() == expected_ranks
    result = layer.prune_ranks()
    assert layer.ranks == expected_ranks
    assert sum(c.numel() for c in layer.cores) == expected_params
    assert (
        result.params_before - result.params_after
        == layer.num_core_parameters(ranks) - expected_params
    )
    assert result.removed[0] == 2
    torch.testing.assert_close(layer(x), before_out, rtol=1e-10, atol=1e-10)
    assert not layer.prune_ranks()  # nothing left to remove


@pytest.mark.parametrize("cls", [TTLinear, TTMLinear])
def test_prune_while_last_graph_is_alive(cls):
    """A loop that still holds last step's loss keeps autograd's per-leaf gradient
    accumulator (with the old core shapes) alive; pruning must make autograd forget it, or
    the next backward fails with a shape mismatch."""
    torch.manual_seed(0)
    layer = cls(16, 12, ranks=4, in_modes=[4, 4], out_modes=[3, 4])
    x = torch.randn(5, 16)
    held = layer(x).square().sum()
    held.backward(retain_graph=True)  # the old graph stays reachable through `held`
    with torch.no_grad():
        layer.gates[0][:2] = 0.0
    assert layer.prune_ranks().total_removed == 2
    layer.zero_grad()
    layer(x).square().sum().backward()
    assert [tuple(c.grad.shape) for c in layer.cores] == [tuple(c.shape) for c in layer.cores]
    assert held.grad_fn is not None  # the old graph really was alive throughout


def test_pruned_layer_saves_and_loads_exactly():
    layer = TTLinear(64, 48, ranks=6)
    with torch.no_grad():
        layer.gates[1][[0, 2, 5]] = 0.0
    layer.prune_ranks()
    buffer = io.BytesIO()
    torch.save(layer.state_dict(), buffer)
    buffer.seek(0)
    fresh = TTLinear(64, 48, ranks=6)  # other ranks: the load resizes it
    fresh.load_state_dict(torch.load(buffer, weights_only=False))
    assert fresh.ranks == layer.ranks
    x = torch.randn(3, 64)
    assert torch.equal(fresh(x), layer(x))
    for a, b in zip(fresh.parameters(), layer.parameters()):
        assert torch.equal(a, b)


def test_load_other_modes_names_both_layouts():
    saved = TTLinear(64, 48, ranks=4, in_modes=[8, 8], out_modes=[6, 8]).state_dict()
    other = TTLinear(64, 48, ranks=4, in_modes=[4, 16], out_modes=[6, 8])
    with pytest.raises(LayoutMismatchError, match=r"in_modes.*\[8, 8\].*in_modes.*\[4, 16\]"):
        other.load_state_dict(saved)


@pytest.mark.parametrize("cls", LINEAR_KINDS)
def test_init_variance_matches_nn_linear(cls):
    x = torch.randn(2048, 768)
    dense_var = nn.Linear(768, 768, bias=False)(x).var().item()
    ours = torch.stack([cls(768, 768, ranks=16, bias=False)(x).var() for _ in range(4)]).mean()
    assert 0.6 < ours.item() / dense_var < 1.6


def test_embedding_init_variance_matches_nn_embedding():
    ids = torch.arange(4000)
    var = torch.stack([TTEmbedding(4000, 64, ranks=16)(ids).var() for _ in range(4)]).mean()
    assert 0.6 < var.item() < 1.6


def test_reference_modes_and_params():
    layer = TTLinear(768, 3072, ranks=30)
    assert layer.in_modes == (12, 8, 8) and layer.out_modes == (12, 16, 16)
    assert layer.ranks == [1, 12, 30, 30, 30, 16, 1]
    assert sum(c.numel() for c in layer.cores) == 28960


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="at most"):
        TTLinear(768, 768, ranks=[13, 30, 30, 30, 12])
    with pytest.raises(ValueError, match="multiply to"):
        TTLinear(100, 10, in_modes=[3, 3])
    with pytest.raises(ValueError, match="positive int"):
        TTMLinear(0, 10)
    with pytest.raises(ValueError, match=r"\(\*, 32\)"):
        TTLinear(32, 8, ranks=2)(torch.randn(4, 31))


@pytest.mark.parametrize(
    "fmt, sizes, kwargs",
    [
        ("tt", (768, 3072), {"ranks": 30}),
        ("tt", (100, 10), {"ranks": 4, "order": 3}),
        ("ttm", (768, 3072), {"ranks": 16}),
        ("ttm", (96, 40), {"ranks": [1, 5, 7, 1], "in_modes": [4, 4, 6]}),
        ("lowrank", (48, 40), {"ranks": 100}),
        ("tt_embedding", (1000, 64), {"ranks": 8}),
        ("tt_embedding", (30, 12), {"ranks": 3, "col_modes": [3, 4]}),
    ],
)
def test_chain_layout_is_what_the_constructor_builds(fmt, sizes, kwargs):
    """The selection pass checks settings with chain_layout instead of building layers:
    the layout must be exactly the built layer's modes and (clipped) ranks."""
    kwargs = dict(kwargs)
    ranks = kwargs.pop("ranks")
    if fmt == "tt_embedding":
        layer = TTEmbedding(*sizes, ranks=ranks, **kwargs)
        first, second = layer.row_modes, layer.col_modes
        modes = (kwargs.get("row_modes"), kwargs.get("col_modes"))
    else:
        cls = {"tt": TTLinear, "ttm": TTMLinear, "lowrank": LowRankLinear}[fmt]
        layer = cls(*sizes, ranks=ranks, **kwargs)
        first, second = layer.in_modes, layer.out_modes
        modes = (kwargs.get("in_modes"), kwargs.get("out_modes"))
    chain = chain_layout(fmt, *sizes, ranks, *modes, kwargs.get("order"))
    assert (chain.first, chain.second, chain.ranks) == (first, second, layer.ranks)


def test_layout_errors_speak_the_layers_words():
    with pytest.raises(ValueError, match=r"in_modes=\[4, 4, 6\] and out_modes=\[5, 8\] need"):
        TTMLinear(96, 40, in_modes=[4, 4, 6], out_modes=[5, 8])
    with pytest.raises(ValueError, match="num_embeddings must be a positive int"):
        chain_layout("tt_embedding", 0, 8, 2)
    with pytest.raises(ValueError, match=r"row_modes=\[2, 3, 5\] .* one row mode per col mode"):
        TTEmbedding(30, 12, row_modes=[2, 3, 5], col_modes=[3, 4])
    with pytest.raises(ValueError, match="one mode per side"):
        LowRankLinear(48, 40, order=2)
    with pytest.raises(ValueError, match="unknown format 'cp'"):
        chain_layout("cp", 4, 4, 2)


def test_dtype_and_leading_dims_like_nn_linear():
    layer = TTLinear(32, 8, ranks=4).to(torch.float64)
    out = layer(torch.randn(2, 3, 4, 32, dtype=torch.float64))
    assert out.shape == (2, 3, 4, 8) and out.dtype == torch.float64
    assert layer(torch.randn(0, 32, dtype=torch.float64)).shape == (0, 8)


def test_gate_threshold_values_and_gradients():
    """Entries with |g| <= threshold are exactly 0 forward and get no gradient; the rest pass."""
    from comera_compile.nn.gates import fold_gates, hard_threshold

    gate = torch.tensor([0.5, -0.01, 0.01, 0.0099, -0.3, 0.02], requires_grad=True)
    out = hard_threshold(gate, 0.01)
    assert out.tolist() == pytest.approx([0.5, 0.0, 0.0, 0.0, -0.3, 0.02])
    out.backward(torch.arange(1.0, 7.0))
    assert gate.grad.tolist() == [1.0, 0.0, 0.0, 0.0, 5.0, 6.0]

    cores = [torch.randn(1, 3, 6, dtype=torch.bfloat16), torch.randn(6, 4, 1, dtype=torch.bfloat16)]
    folded = fold_gates(cores, [gate.detach()], 0.01)
    assert folded[0].dtype == torch.bfloat16 and folded[1] is cores[1]
    keep = torch.tensor([1.0, 0, 0, 0, 1, 1])
    expected = cores[0].float() * (gate.detach() * keep)
    assert torch.allclose(folded[0].float(), expected, atol=1e-2)
    assert (folded[0][..., 1:4] == 0).all()
