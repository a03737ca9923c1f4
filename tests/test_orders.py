"""TT orders 1 (low-rank) to 4: outputs and gradients equal to the dense reconstruction,
and layer_config forcing an order or the low-rank format."""

import pytest
import torch
from torch import nn

import comera_compile as cc
from comera_compile.nn import LowRankLinear, TTLinear
from tests.models import dlrm_batch, small_dlrm


def _layer(order: int) -> TTLinear:
    torch.manual_seed(order)
    if order == 1:
        layer = LowRankLinear(48, 40, ranks=5)
    else:
        layer = TTLinear(48, 40, ranks=5, order=order)
    layer = layer.double()
    with torch.no_grad():
        for gate in layer.gates:
            gate.uniform_(0.5, 1.5)
    return layer


@pytest.mark.parametrize("order", [1, 2, 3, 4])
def test_order_output_and_gradients_match_dense(order):
    layer = _layer(order)
    assert len(layer.in_modes) == len(layer.out_modes) == order
    x = torch.randn(7, 48, dtype=torch.float64, requires_grad=True)
    target = torch.randn(7, 40, dtype=torch.float64)

    y = layer(x)
    torch.testing.assert_close(y, x @ layer.to_dense().T + layer.bias, rtol=1e-10, atol=1e-10)
    ((y - target) ** 2).sum().backward()
    planned = [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]

    x.grad = None
    layer.zero_grad(set_to_none=True)
    dense = x @ layer.to_dense().T + layer.bias  # autograd through the reconstruction
    ((dense - target) ** 2).sum().backward()
    reference = [x.grad] + [p.grad for p in layer.parameters()]
    assert len(planned) == len(reference) == 1 + 2 * order + (2 * order - 1) + 1
    for got, want in zip(planned, reference):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


def test_lowrank_is_u_times_v():
    layer = _layer(1)
    u, v = layer.cores[0][0], layer.cores[1][..., 0]  # (in, r), (r, out)
    gate = layer.gates[0]
    torch.testing.assert_close(layer.to_dense(), ((u * gate) @ v).T)
    assert layer.rank == 5
    assert sum(p.numel() for p in layer.parameters()) == 5 * (48 + 40) + 5 + 40


def test_lowrank_from_dense_is_truncated_svd():
    torch.manual_seed(0)
    dense = nn.Linear(20, 16).double()
    layer = LowRankLinear.from_dense(dense, ranks=6)
    s = torch.linalg.svdvals(dense.weight.detach())
    err = torch.linalg.matrix_norm(layer.to_dense() - dense.weight.detach())
    torch.testing.assert_close(err, s[6:].norm())  # Eckart-Young: the best rank-6 error


def test_lowrank_refuses_several_modes():
    with pytest.raises(ValueError, match="one mode per side"):
        LowRankLinear(48, 40, ranks=4, order=2)
    with pytest.raises(ValueError, match="one mode per side"):
        LowRankLinear(48, 40, ranks=4, in_modes=[6, 8])


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 64))


@pytest.mark.parametrize(
    ("config", "cls", "modes"),
    [
        ({"format": "lowrank"}, LowRankLinear, ((64,), (96,))),
        ({"order": 2}, TTLinear, ((8, 8), (8, 12))),
        ({"order": 3}, TTLinear, ((4, 4, 4), (4, 4, 6))),
    ],
)
def test_layer_config_forces_order_or_lowrank(config, cls, modes):
    model = cc.optimize(_mlp(), cc.CompressionConfig(layer_config={"0": {**config, "ranks": 4}}),
                        compile=False)
    layer = model.get_submodule("0")
    assert type(layer) is cls
    assert (layer.in_modes, layer.out_modes) == modes
    x = torch.randn(5, 64)
    hidden = torch.relu(x @ layer.to_dense().T + layer.bias)
    torch.testing.assert_close(model(x), model.get_submodule("2")(hidden))


def test_optimize_lowrank_format_dense_init_is_exact_at_full_rank():
    dense = _mlp().double()
    model = cc.optimize(dense, cc.CompressionConfig(max_rank=64), format="lowrank", init="dense",
                        compile=False)
    assert all(isinstance(m, LowRankLinear) for m in cc.nn.tensorized_layers(model).values())
    x = torch.randn(3, 64, dtype=torch.float64)
    torch.testing.assert_close(model(x), dense(x), rtol=1e-9, atol=1e-9)
    reasons = {r["order_reason"] for r in cc.summary(model).records}
    assert reasons == {"one mode per side: format='lowrank' (W = U V)"}


# ----- order choice by planned training cost ----------------------------------------------
def _candidate(fan_in: int, fan_out: int):
    from comera_compile.passes.candidates import find_candidates

    return find_candidates(nn.Sequential(nn.Linear(fan_in, fan_out)))[0]


@pytest.mark.parametrize(("shape", "default", "cap", "rows"), [
    ((768, 768), 3, 8, 32), ((768, 768), 3, 8, 512), ((64, 96), 2, 30, 32), ((64, 96), 2, 30, 512),
])
def test_order_choice_is_the_cheapest_planned_training_step(shape, default, cap, rows):
    from comera_compile.passes.order import choose_tt_order, planned_training_cost

    choice = choose_tt_order(_candidate(*shape), cap, rows)
    reference = next(o for o in choice.options if o.order == default)
    assert max(reference.spec.ranks) == cap  # the default order sets the parameter count
    reference = reference.params
    assert {o.order for o in choice.options} == {2, 3, 4}
    for option in choice.options:  # similar expressiveness: about the same parameters
        assert 0.8 * reference <= option.params <= reference
        assert option.cost == planned_training_cost(option.spec, rows)
    assert choice.chosen.cost == min(o.cost for o in choice.options)
    assert f"order {choice.chosen.order}" not in choice.reason.split(" vs ")[-1]


def test_order_choice_changes_with_the_batch():
    from comera_compile.passes.order import choose_tt_order

    cand = _candidate(768, 768)
    assert [choose_tt_order(cand, 8, rows).chosen.order for rows in (1, 32, 512)] == [2, 3, 2]
    cand = _candidate(64, 96)
    assert [choose_tt_order(cand, 30, rows).chosen.order for rows in (32, 512)] == [2, 4]


def test_order_choice_follows_the_cost_model(monkeypatch):
    """Swap the cost model for one that favours a given order: the choice must follow it."""
    from comera_compile.passes import order

    for favourite in (2, 3, 4):
        monkeypatch.setattr(order, "planned_training_cost",
                            lambda spec, *a, f=favourite: abs(len(spec.in_modes) - f))
        assert order.choose_tt_order(_candidate(768, 768), 16, 64).chosen.order == favourite


def test_optimize_reports_the_order_and_layer_config_overrides_it():
    x = torch.randn(512, 64)
    model = cc.optimize(_mlp(), cc.CompressionConfig(max_rank=30, layer_config={"2": {"order": 3}}),
                        format="tt", example_inputs=x, compile=False)
    auto, forced = model.get_submodule("0"), model.get_submodule("2")
    assert len(forced.in_modes) == 3
    assert len(auto.in_modes) == 4  # cheapest planned step for 64x96 at 512 rows (above)
    records = {r["name"]: r for r in cc.summary(model).records}
    assert records["0"]["order"] == 4
    assert records["0"]["order_reason"].startswith("order 4: lowest planned training cost")
    assert records["2"]["order_reason"] == "set in layer_config (order)"
    table = str(cc.summary(model))
    assert "order (modes per side) chosen:" in table
    hidden = torch.relu(x @ auto.to_dense().T + auto.bias)
    torch.testing.assert_close(model(x), hidden @ forced.to_dense().T + forced.bias,
                               rtol=1e-4, atol=1e-5)


# ----- embedding tables: order by multiply-adds per looked-up row ------------------------
class _Table(nn.Module):
    def __init__(self, rows: int, sparse: bool = True):
        super().__init__()
        self.table = nn.EmbeddingBag(rows, 16, mode="sum", sparse=sparse)

    def forward(self, ids):
        return self.table(ids)


def _row_macs(col_modes, ranks):
    """Building a row: the gathered slices contracted left to right, width = dims so far."""
    width, macs = col_modes[0], 0
    for k in range(1, len(col_modes)):
        width *= col_modes[k]
        macs += width * ranks[k] * ranks[k + 1]
    return macs


def test_embedding_order_is_the_fewest_macs_per_row_at_equal_parameters():
    from comera_compile.passes.candidates import find_candidates
    from comera_compile.passes.order import choose_embedding_order

    cand = find_candidates(_Table(1_000_000))[0]
    choice = choose_embedding_order(cand, 30)
    default = next(o for o in choice.options if o.order == 6)  # 1M rows: 6 cores by default
    assert default.spec.row_modes == (10,) * 6 and default.spec.col_modes == (1, 1, 2, 2, 2, 2)
    assert {o.order for o in choice.options} == {2, 3, 4, 5, 6}
    for option in choice.options:
        assert 0.8 * default.params <= option.params <= default.params
        assert option.cost == _row_macs(option.spec.col_modes, option.spec.ranks)
    assert len(choice.options) == 10  # each order: the default dim split and the dim last
    chosen = choice.chosen
    assert chosen.order == 2 and chosen.spec.row_modes == (1000, 1000)
    assert chosen.spec.col_modes == (1, 16)  # a rank-wide row, widened to 16 by the last core
    r = chosen.spec.ranks[1]
    assert chosen.spec.ranks == (1, r, 1)
    assert chosen.cost == 16 * r < default.cost / 5
    assert chosen.cost == min(o.cost for o in choice.options)
    three = next(o for o in choice.options if o.spec.col_modes == (1, 1, 16))
    assert three.cost == three.spec.ranks[1] ** 2 + 16 * three.spec.ranks[1] > chosen.cost


def test_optimize_gives_a_large_table_the_cheaper_order_under_a_budget():
    with torch.device("meta"):
        model = _Table(1_000_000)
    ids = torch.zeros(64, 1, dtype=torch.long, device="meta")
    out = cc.optimize(model, "100x", example_inputs=(ids,), compile=False, inplace=True)
    table = out.table
    assert table.row_modes == (1000, 1000) and table.col_modes == (1, 16)
    r = table.ranks[1]
    params = sum(p.numel() for p in table.parameters())  # cores 1000r + 16000r, r gates
    assert params == 17_001 * r <= 160_000 < 17_001 * (r + 1)
    records = {r["name"]: r for r in cc.summary(out).records}
    assert records["table"]["macs_per_row_after"] == 16 * r
    assert records["table"]["order_reason"].startswith(
        "order 2: fewest multiply-adds per looked-up row")
    assert "order 6" in records["table"]["order_reason"]
    with torch.device("meta"):
        model = _Table(1_000_000)
    forced = cc.optimize(model, cc.CompressionConfig(budget="100x",
                                                     layer_config={"table": {"order": 6}}),
                         example_inputs=(ids,), compile=False, inplace=True)
    assert len(forced.table.row_modes) == 6
    with torch.device("meta"):  # too narrow a table to factorize: the default layout
        model = _Table(1_000_000, sparse=False)
    plain = cc.optimize(model, "100x", example_inputs=(ids,), compile=False, inplace=True)
    assert plain.table.row_modes == (10,) * 6


class _TinyLM(nn.Module):
    def __init__(self, vocab: int = 4000, dim: int = 256) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        return self.head(torch.relu(self.mix(self.tokens(ids))))


def test_a_token_table_trained_from_scratch_is_factorized_and_a_pretrained_one_is_not():
    """init='random': a (non-recommender) table gets the low-rank layout A B, whose lookup is
    one matmul of the looked-up rows; init='dense' keeps the default TT layout (it sets the
    truncation error of the pretrained weights)."""
    from comera_compile.passes.order import FACTORIZED_TABLE

    torch.manual_seed(0)
    ids = torch.randint(0, 4000, (8, 32))
    model = cc.optimize(_TinyLM(), budget=0.25, example_inputs=(ids,), compile=False)
    table = model.tokens
    assert table.row_modes == (4000, 1) and table.col_modes == (1, 256)
    assert not table.lookup_outgrows_rows  # nothing for a lean step to recompute
    records = {r["name"]: r for r in cc.summary(model).records}
    assert records["tokens"]["order_reason"] == FACTORIZED_TABLE
    a, b = (core.detach() for core in table.cores)  # slices first: (4000, 1, 1, r), (1, r, 256, 1)
    torch.testing.assert_close(table(ids[0]), (a[ids[0], 0, 0] * _gate(table)) @ b[0, :, :, 0])
    losses = []
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(30):  # a next-token task: the factorized table trains
        loss = nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
    pretrained = cc.optimize(_TinyLM(), budget=0.25, init="dense", compile=False)
    assert len(pretrained.tokens.row_modes) > 2 and pretrained.tokens.lookup_outgrows_rows


def _gate(table) -> torch.Tensor:
    """The table's bond gate as its lookup applies it (hard threshold)."""
    from comera_compile.nn.gates import hard_threshold

    return hard_threshold(table.gates[0], table.threshold).detach()


def test_a_recommender_table_takes_the_cheapest_layout_at_the_parameters_it_is_given():
    """Layouts are compared again once the budget is spread: at 1/20 of a 400,000 x 64
    table, the whole dim in the last core costs a quarter of the default split's
    multiply-adds per row, within the same parameters; a layout set in layer_config stays."""
    torch.manual_seed(0)
    model = small_dlrm((400_000, 1000), dim=64, sparse=True)
    batch = dlrm_batch(model, batch=64)
    config = cc.CompressionConfig(budget="20x", compile=False, row_cache=0)
    records = {r["name"]: r for r in cc.summary(
        cc.optimize(model, config, example_inputs=batch)).records}
    table = records["tables.0"]
    assert table["out_modes"] == [1, 64]
    assert "at the ~" in table["order_reason"] and "parameters the budget gave it" in (
        table["order_reason"])
    rank = table["ranks"][1]
    assert table["in_modes"][0] * rank + table["in_modes"][1] * rank * 64 <= 25_600_000 / 20
    config = cc.CompressionConfig(budget="20x", compile=False, row_cache=0,
                                  layer_config={"tables.0": {"order": 2}})
    records = {r["name"]: r for r in cc.summary(
        cc.optimize(model, config, example_inputs=batch)).records}
    assert records["tables.0"]["out_modes"] == [8, 8]  # the default split of order 2
