"""Compiling a model's repeated blocks: which modules are blocks, one graph for blocks of
equal shapes, outputs and gradients equal to eager, and eager calls left eager."""

import copy

import pytest
import torch
from torch import nn

import comera_compile as cc
from comera_compile.compile import compile_model
from comera_compile.compile.backend import graphs_compiled
from comera_compile.compile.graph.absorbed_attention import attentions_absorbed
from comera_compile.compile.policy.blocks import (
    _without_training_cache,
    blocks_pay,
    distinct_shapes,
    repeated_blocks,
    shared_blocks,
)
from comera_compile.compile.policy.measured import MeasuredCompile


class Block(nn.Module):
    def __init__(self, width: int = 16, rank: int = 3) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = cc.TTLinear(width, 2 * width, ranks=rank, in_modes=[4, 4], out_modes=[4, 8])
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, ranks=(3, 3, 3)) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.layers = nn.ModuleList(Block(rank=r) for r in ranks)
        self.head = cc.TTLinear(16, 16, ranks=2, in_modes=[4, 4], out_modes=[4, 4])

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_blocks_are_the_members_of_a_stack_of_one_class():
    model = Stack()
    assert repeated_blocks(model) == list(model.layers)
    # a stack inside a block is that block's: only the outer stack counts
    outer = nn.Sequential(*(nn.Sequential(Block(), Block()) for _ in range(2)))
    assert repeated_blocks(outer) == list(outer)
    # no tensorized layer, mixed classes, a lone block, or tensorized leaves: no blocks
    assert repeated_blocks(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))) == []
    assert repeated_blocks(nn.Sequential(Block(), nn.ReLU(), Block())) == []
    assert repeated_blocks(nn.ModuleList([Block()])) == []
    leaves = nn.ModuleList(cc.TTLinear(16, 16, ranks=2, in_modes=[4, 4], out_modes=[4, 4])
                           for _ in range(3))
    assert repeated_blocks(leaves) == []


def test_torch_transformer_encoder_layers_are_blocks():
    layer = nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
    x = torch.randn(2, 8, 64)
    model = cc.optimize(encoder, budget=None, example_inputs=(x,), compile=False)
    assert repeated_blocks(model) == list(model.layers)


def _projected_loss(out: torch.Tensor) -> torch.Tensor:
    proj = torch.randn(out.shape[-1], generator=torch.Generator().manual_seed(1))
    return (out @ proj).square().mean()  # not .sum(): the gradient must not vanish


def _prune_first_bonds(model: nn.Module, keep: int) -> None:
    for layer in model.modules():
        if isinstance(layer, cc.TTLinear) and layer.ranks[1] > keep:
            with torch.no_grad():
                layer.gates[0][keep:] = 0.0
            layer.prune_ranks()


@pytest.mark.parametrize("symbolic_ranks, graphs", [(True, 1), (False, 2)])
def test_blocks_share_graphs_and_match_eager(symbolic_ranks, graphs):
    torch.manual_seed(0)
    eager = Stack(ranks=(3, 3, 5))  # two blocks of one shape, one of another rank
    model = copy.deepcopy(eager)
    compile_model(model, inplace=True, blocks=True, symbolic_ranks=symbolic_ranks)
    x = torch.randn(4, 8)
    before = graphs_compiled()
    out = model(x)
    _projected_loss(out).backward()
    # symbolic ranks: one graph for all; static: one per distinct set of block shapes
    assert graphs_compiled() - before == graphs
    assert model._compiled_call_impl.describe() == "3 Block blocks compiled, the rest eager"
    ref = eager(x)
    _projected_loss(ref).backward()
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), name
    # the model's eager form (what a measured compile races against) runs blocks eager
    before = graphs_compiled()
    assert torch.allclose(model._call_impl(x), ref, rtol=1e-5, atol=1e-6)
    assert model(x).shape == ref.shape and graphs_compiled() == before
    # a rank cut: symbolic ranks compile nothing, static ranks a graph per new shape
    for m in (model, eager):
        _prune_first_bonds(m, keep=2)
    before = graphs_compiled()
    out, ref = model(x), eager(x)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
    assert (graphs_compiled() - before == 0) == symbolic_ranks


def test_blocks_true_without_blocks_names_the_fix():
    model = nn.Sequential(cc.TTLinear(16, 16, ranks=2, in_modes=[4, 4], out_modes=[4, 4]))
    with pytest.raises(ValueError, match="blocks=None or False"):
        compile_model(model, inplace=True, blocks=True)
    with pytest.raises(ValueError, match="inplace=True"):
        compile_model(Stack(), blocks=True)


def test_measured_compile_keeps_blocks_of_symbolic_ranks_through_cuts():
    # by default ranks turn symbolic where the run will cut them: blocks of other ranks
    # then share a graph, and a cut compiles nothing
    model = compile_model(Stack(ranks=(3, 3, 5)), inplace=True, measure=True)
    impl = model._compiled_call_impl
    assert isinstance(impl, MeasuredCompile) and impl.blocks is not None
    impl.shapes_change_after(10)
    assert impl.compiled_form is impl.blocks and not impl.cuts_recompile
    assert impl.blocks.enabled and impl.compiled.enabled
    # a run that does not cut: static ranks, so two shapes for three blocks compile whole
    model = compile_model(Stack(ranks=(3, 3, 5)), inplace=True, measure=True)
    impl = model._compiled_call_impl
    assert impl.compiled_form is impl.compiled and impl.cuts_recompile
    assert "its 3 blocks have 2 shapes" in impl.whole_why
    # asked for symbolic ranks: blocks at once
    options = cc.CompileOptions(symbolic_ranks=True)
    model = compile_model(Stack(ranks=(3, 3, 5)), options, inplace=True, measure=True)
    assert model._compiled_call_impl.compiled_form is model._compiled_call_impl.blocks
    # a rank trainer that prunes learns that cuts compile nothing: the run's end is the
    # horizon, and it prunes as an eager model does
    model = compile_model(Stack(), inplace=True, measure=True)
    optimizer = torch.optim.AdamW(model.parameters())
    cc.training.RankAdaptiveTrainer(model, optimizer, target_ratio=0.5, early_steps=10,
                                    total_steps=100)
    impl = model._compiled_call_impl
    assert impl.compiled_form is impl.blocks
    assert impl.calls_before_change == 100 and impl.why_not_recompile(1) == ""


def test_measured_compile_at_static_ranks_uses_blocks_unless_shapes_will_change():
    static = cc.CompileOptions(symbolic_ranks=False)
    model = compile_model(Stack(), static, inplace=True, measure=True)
    impl = model._compiled_call_impl
    assert isinstance(impl, MeasuredCompile) and impl.blocks is not None
    assert impl.compiled_form is impl.blocks
    # a run that will cut ranks compiles the whole model: cut blocks would differ
    model = compile_model(Stack(), static, inplace=True, measure=True)
    impl = model._compiled_call_impl
    impl.shapes_change_after(10)
    assert impl.compiled_form is impl.compiled and impl.cuts_recompile
    assert "cuts ranks" in impl.whole_why
    model = compile_model(Stack(), static, inplace=True, measure=True)
    impl = model._compiled_call_impl
    impl.expect_cuts()  # cuts of unknown time: the same
    assert impl.compiled_form is impl.compiled
    # a rank trainer that prunes says so at once
    model = compile_model(Stack(), static, inplace=True, measure=True)
    optimizer = torch.optim.AdamW(model.parameters())
    cc.training.RankAdaptiveTrainer(model, optimizer, target_ratio=0.5)
    assert model._compiled_call_impl.compiled_form is model._compiled_call_impl.compiled
    # fewer than three blocks per shape (3 blocks, 2 shapes): the whole model by default,
    # and the summary says why
    model = compile_model(Stack(ranks=(3, 3, 5)), static, inplace=True, measure=True)
    impl = model._compiled_call_impl
    race = impl.races["training"]
    race.choice, race.speedup = "compiled", 1.2  # as a finished race leaves it
    assert impl.compiled_form is impl.compiled
    assert ("compiled (the whole model: its 3 blocks have 2 shapes, and blocks compile where "
            "3 or more share one), 1.20x") in impl.describe()
    # blocks=False: the whole model
    model = compile_model(Stack(), cc.CompileOptions(blocks=False), inplace=True, measure=True)
    assert model._compiled_call_impl.blocks is None


def test_blocks_pay_where_each_graph_serves_three_blocks():
    # symbolic ranks (the default): blocks that differ in rank alone share a graph
    assert distinct_shapes([Block(rank=3), Block(rank=3), Block(rank=5)]) == 1
    assert blocks_pay([Block(rank=r) for r in (3, 3, 5)])
    assert not blocks_pay([Block(rank=r) for r in (3, 5)])
    other = Block(rank=3)
    other.down = nn.Linear(32, 16, bias=False)  # another shape than a rank's
    assert distinct_shapes([Block(rank=3), other]) == 2
    # static ranks: each set of ranks is a shape
    assert distinct_shapes([Block(rank=3), Block(rank=3), Block(rank=5)], False) == 2
    assert blocks_pay([Block(rank=r) for r in (3, 3, 3, 5, 5, 5)], False)
    assert not blocks_pay([Block(rank=r) for r in (3, 3, 5, 5)], False)
    assert not blocks_pay([])
    # one block of a rare shape among three that share one: the three compile, it runs eager
    blocks = [other, *(Block(rank=3) for _ in range(3))]
    assert blocks_pay(blocks) and shared_blocks(blocks) == blocks[1:]
    assert shared_blocks(blocks + [Block(rank=5)], False) == blocks[1:]


def test_a_block_of_rare_shapes_runs_eager_beside_compiled_blocks():
    torch.manual_seed(0)
    eager = Stack(ranks=(3, 3, 3, 3))
    eager.layers[0].down = nn.Linear(32, 16, bias=False)  # the budget left it otherwise
    model = copy.deepcopy(eager)
    compile_model(model, inplace=True, symbolic_ranks=True)  # default blocks: the rule
    impl = model._compiled_call_impl
    assert impl.compiled_blocks == list(model.layers)[1:]
    assert impl.describe() == ("3 of 4 Block blocks compiled (the others have shapes fewer "
                               "than 3 share), the rest eager")
    x = torch.randn(4, 8)
    before = graphs_compiled()
    out = model(x)
    _projected_loss(out).backward()
    assert graphs_compiled() - before == 1  # one graph: the odd block ran eager
    with pytest.raises(RuntimeError, match="before the first call"):
        impl.select(list(model.layers))
    ref = eager(x)
    _projected_loss(ref).backward()
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), name
    # a measured compile makes the same choice at its first compiled call
    model = compile_model(copy.deepcopy(eager), inplace=True, measure=True)
    impl = model._compiled_call_impl
    impl.shapes_change_after(10)
    assert impl.compiled_form is impl.blocks
    assert impl.blocks.compiled_blocks == list(model.layers)[1:] and not impl.cuts_recompile
    assert impl.compiled_share == 0.75  # what a profiled estimate scales its gain by


def test_blocks_option_is_checked_and_not_a_backend_option():
    with pytest.raises(TypeError, match="blocks"):
        cc.CompileOptions(blocks="yes")
    assert "blocks" not in cc.CompileOptions(blocks=True).to_backend_options()
    assert cc.CompileOptions.from_dict(cc.CompileOptions(blocks=True).to_dict()).blocks is True


def test_torch_encoder_blocks_keep_symbolic_ranks_through_a_cut():
    """Modules inside torch's own (``nn.TransformerEncoderLayer``) have their parameters'
    shapes forced static by dynamo unless told otherwise: a cut must still compile nothing."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
    x = torch.randn(2, 8, 64)
    eager = cc.optimize(encoder, budget=0.3, example_inputs=(x,), compile=False).eval()
    model = copy.deepcopy(eager)
    compile_model(model, inplace=True, symbolic_ranks=True)
    absorbed = attentions_absorbed()
    with torch.no_grad():
        assert torch.allclose(model(x), eager(x), rtol=1e-5, atol=1e-6)
        assert attentions_absorbed() > absorbed  # bonds of 9 < heads of 16, symbolic
        _prune_first_bonds(model, keep=2)
        _prune_first_bonds(eager, keep=2)
        before = graphs_compiled()
        assert torch.allclose(model(x), eager(x), rtol=1e-5, atol=1e-6)
    assert graphs_compiled() == before


def test_hugging_face_decoder_blocks_share_one_graph_in_training():
    # HF decoders build a key-value cache indexed by layer number unless use_cache=False:
    # compiled blocks run training calls without it, so the blocks share one graph
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=100, hidden_size=64, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=256, max_position_embeddings=32)
    assert config.use_cache
    ids = torch.randint(0, 100, (2, 8))
    eager = cc.optimize(tf.LlamaForCausalLM(config), budget=0.5, example_inputs=(ids,),
                        compile=False)
    model = copy.deepcopy(eager)
    compile_model(model, inplace=True, symbolic_ranks=True)
    assert model._compiled_call_impl.describe().startswith("3 LlamaDecoderLayer blocks")
    before = graphs_compiled()
    out = model(ids).logits
    _projected_loss(out).backward()
    assert graphs_compiled() - before == 1
    ref = eager(ids).logits
    _projected_loss(ref).backward()
    assert torch.allclose(out, ref, rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-3, atol=1e-5), name
    # the caller's own use_cache, and inference calls, are left as they are
    assert _without_training_cache(model, {}) == {"use_cache": False}
    assert _without_training_cache(model, {"use_cache": True}) == {"use_cache": True}
    with torch.no_grad():
        assert _without_training_cache(model, {}) == {}
    assert _without_training_cache(Stack(), {}) == {}  # no config asking for a cache
    # an evaluation call builds the cache the caller may read: its blocks run eager, rather
    # than one graph per layer (each guarded on its own slot of the cache)
    model.eval()
    eager.eval()
    before = graphs_compiled()
    with torch.no_grad():
        out, ref = model(ids), eager(ids)
    assert graphs_compiled() == before
    assert out.past_key_values is not None and out.past_key_values.get_seq_length() == 8
    assert torch.allclose(out.logits, ref.logits, rtol=1e-4, atol=1e-5)
    with torch.no_grad():  # without the cache, the blocks' evaluation graph: one for all
        model(ids, use_cache=False)
    assert graphs_compiled() - before == 1
