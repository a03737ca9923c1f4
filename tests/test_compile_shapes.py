"""Shapes under the ``comera`` backend: one graph per plan region (not per batch size), one
recompile per prune, ranks rounded to aligned sizes, autotuning on real tensors."""

import copy

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import comera_compile.compile as cc
from comera_compile.compile.backend import comera_backend
from comera_compile.nn import TTLinear, TTMLinear
from comera_compile.planner import clear_memory_cache, planning
from comera_compile.planner.cache import get_plan
from comera_compile.planner.networks import tt_linear_network
from comera_compile.planner.ops import row_bucket
from comera_compile.planner.protocol import RowCost
from comera_compile.planner.regions import guard_to_region, region_of


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


class LinearCostPlan:
    """A plan whose cost at ``rows`` is ``per_row * rows + fixed``."""

    def __init__(self, per_row: float, fixed: float) -> None:
        self.per_row, self.fixed = per_row, fixed

    def cost_at(self, rows: int):
        return RowCost(0, 0, self.per_row * rows + self.fixed, {})


def test_a_region_is_the_run_of_buckets_its_plan_serves_within_the_slack():
    weights_first, rows_first = LinearCostPlan(10, 0), LinearCostPlan(1, 200)

    def plan_at(bucket):  # the cheaper one: weights first up to 16 rows, then rows first
        return min(weights_first, rows_first, key=lambda p: p.cost_at(bucket).cost)

    assert region_of(plan_at, 4, slack=0.1) == (1, 16)
    assert region_of(plan_at, 16, slack=0.1) == (1, 16)
    assert region_of(plan_at, 64, slack=0.1) == (32, None)  # no upper bound
    # with 50% slack each plan also serves the first bucket past the switch (320 <= 348)
    assert region_of(plan_at, 16, slack=0.5) == (1, 32)
    assert region_of(plan_at, 64, slack=0.5) == (16, None)
    guard_to_region(5, 8, 256)  # 4 < 5 <= 256: bucket 8
    guard_to_region(256, 8, 256)
    guard_to_region(10**9, 512, None)
    for rows in (4, 257):
        with pytest.raises(AssertionError, match="outside the plan region"):
            guard_to_region(rows, 8, 256)


def test_eight_batch_sizes_over_eight_buckets_compile_two_graphs():
    model = mlp()
    backend = CountingBackend()
    compiled = torch.compile(model, backend=backend)
    for batch in (1, 2, 3, 5, 8, 16, 40, 128):  # 16..2048 rows: eight buckets, one region
        x = torch.randn(batch, 16, 64)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert backend.graphs == 2  # the first size static, then one symbolic graph for all
    orders = {plan.order_expression() for k, plan in cc.traced_plans().items()
              if k[1:3] == ((8, 8), (6, 8)) and k[4] >= 16}  # (the dict spans the session)
    assert orders == {"(x . (G1 . G2)) . (G3 . G4)"}


def test_a_batch_that_needs_another_program_compiles_another_graph():
    model = mlp()  # TTLinear: weights first up to 8 rows, rows first from 8 rows on
    backend = CountingBackend()
    compiled = torch.compile(model, backend=backend)
    graphs = []
    for rows in (32, 64, 4, 8, 48, 3, 1000):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
        graphs.append(backend.graphs)
    # 32 static; 64 symbolic (its plan serves 5+ rows within the slack); 4 (1-4 rows);
    # then 8, 48, 3 and 1000 rows reuse those
    assert graphs == [1, 2, 3, 3, 3, 3, 3]
    plans = {k[4]: plan for k, plan in cc.traced_plans().items() if k[1:3] == ((8, 8), (6, 8))}
    assert plans[4].order_expression() == "(((x . G1) . G2) . G3) . G4"
    assert plans[64].order_expression() == "(x . (G1 . G2)) . (G3 . G4)"
    # 8 rows ran the 64-row plan: another order, within 10% of the 8-row bucket's best
    best_8 = get_plan(tt_linear_network((8, 8), (6, 8), [1, 4, 4, 4, 1], 8),
                      dtype=torch.float32, device_type="cpu")
    assert best_8.order_expression() != plans[64].order_expression()
    assert plans[64].cost_at(8).cost <= 1.1 * best_8.cost_at(8).cost


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


def test_dropout_in_train_mode_keeps_the_batch_symbolic_under_inductor():
    """The CPU dropout's random words are laid out per row, so the mask adds no guard
    on the batch size: sizes 1..128 x 16 compile two graphs, as without dropout."""
    torch.manual_seed(0)
    model = nn.Sequential(
        TTLinear(64, 48, ranks=4), nn.Dropout(0.25), nn.GELU(), TTMLinear(48, 40, ranks=3)
    ).train()
    graphs = []

    def counting(gm, example_inputs, **kwargs):
        graphs.append(gm)
        return comera_backend(gm, example_inputs)

    compiled = torch.compile(model, backend=counting)
    for batch in (1, 2, 3, 5, 8, 16, 40, 128):
        x = torch.randn(batch, 16, 64, requires_grad=True)
        out = compiled(x)
        out.sum().backward()
        assert out.shape == (batch, 16, 40) and torch.isfinite(x.grad).all()
    assert len(graphs) == 2
    x = torch.randn(40, 16, 64)
    assert not torch.equal(compiled(x), compiled(x))  # dropout is on: new masks each call


def test_in_place_compile_of_a_torch_module_is_one_graph_not_one_per_layer():
    """``nn.TransformerEncoder.forward`` lives in torch's own files, which dynamo does not
    start tracing from: the in-place compile enters through a frame of ours instead."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    for block in model.layers:  # two TT shapes: compiled one by one, each a graph family
        block.linear1 = TTLinear(64, 128, ranks=4)
        block.linear2 = TTLinear(128, 64, ranks=4)
    eager = copy.deepcopy(model)
    counters.clear()
    compiled = cc.compile_model(model, inplace=True, inductor=False)
    assert compiled is model and type(model) is nn.TransformerEncoder
    for batch in (2, 3, 5, 9):
        x = torch.randn(batch, 8, 64)
        torch.testing.assert_close(model(x), eager(x), rtol=1e-4, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 2  # batch 2 static, then one symbolic


@pytest.mark.slow
def test_hugging_face_t5_with_a_tt_embedding_trains_compiled_across_batch_sizes():
    """T5's shared embedding (a TT table read by encoder and decoder, tied to the head): a
    second batch size compiles a dynamic graph whose backward must bind the batch (an index
    of the ids' count, saved for backward, once left it unbound and inductor failed)."""
    tf = pytest.importorskip("transformers")
    import comera_compile as api
    from comera_compile.nn import TTEmbedding

    torch.manual_seed(0)
    dense = tf.T5ForConditionalGeneration(tf.T5Config(
        vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=1, num_heads=4,
        dropout_rate=0.0, decoder_start_token_id=0))

    def batch(size):
        ids = torch.randint(0, 128, (size, 12))
        return {"input_ids": ids, "decoder_input_ids": ids[:, :6]}

    model = api.optimize(dense.train(),
                         api.CompressionConfig(filter_fn=lambda module, name: name == "shared"),
                         example_inputs=batch(2), compile=False)  # the table only
    assert isinstance(model.get_submodule("shared"), TTEmbedding)
    compiled = torch.compile(copy.deepcopy(model), backend="comera")
    for size in (2, 3):  # the second compiles the dynamic graph
        inputs = batch(size)
        want = model(**inputs).logits
        got = compiled(**inputs).logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        proj = torch.randn(want.shape[-1])
        g_want = torch.autograd.grad((want @ proj).square().mean(), list(model.parameters()))
        g_got = torch.autograd.grad((got @ proj).square().mean(), list(compiled.parameters()))
        for a, b in zip(g_got, g_want):  # eager lookups sum in C, in another order
            torch.testing.assert_close(a, b, rtol=1e-3, atol=5e-5)
