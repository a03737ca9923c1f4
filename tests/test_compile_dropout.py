"""Dropout in CPU graphs: masks hashed from element indices and random keys, same
distribution and gradients as aten's dropout, and what the backend compiles uses them."""

import pytest
import torch
import torch.nn.functional as F

from comera_compile.compile.cpu.dropout import DropoutTag, decompositions, keep_mask, native_dropout


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_mask_keeps_one_minus_p_of_the_elements(p):
    torch.manual_seed(0)
    n = 1_000_003
    keep = keep_mask(torch.Size([n]), p, torch.device("cpu"))
    assert keep.dtype == torch.bool and keep.shape == (n,)
    # binomial standard deviation sqrt(p (1-p) / n) <= 5e-4: six of them
    assert keep.float().mean().item() == pytest.approx(1 - p, abs=3e-3)
    # no structure along the index: every residue class mod 8 keeps 1 - p of its elements
    classes = keep[: n - n % 8].view(-1, 8).float().mean(0)
    torch.testing.assert_close(classes, torch.full((8,), 1 - p), atol=8e-3, rtol=0)


def test_keep_masks_are_independent_between_calls_and_neighbours_and_follow_the_seed():
    """Two calls (two dropout layers) draw uncorrelated masks, neighbouring elements are
    uncorrelated, and ``torch.manual_seed`` reproduces a mask."""
    n, cpu = 1 << 20, torch.device("cpu")
    torch.manual_seed(3)
    first, second = (keep_mask(torch.Size([n]), 0.5, cpu).float() for _ in range(2))
    # a correlation of n independent pairs has standard deviation 1/sqrt(n) ~ 1e-3
    assert abs(torch.corrcoef(torch.stack([first, second]))[0, 1]) < 5e-3
    assert abs(torch.corrcoef(torch.stack([first[:-1], first[1:]]))[0, 1]) < 5e-3
    assert abs(torch.corrcoef(torch.stack([first[:-128], first[128:]]))[0, 1]) < 5e-3
    torch.manual_seed(3)
    assert torch.equal(keep_mask(torch.Size([n]), 0.5, cpu).float(), first)
    square = keep_mask(torch.Size([512, 512]), 0.5, cpu)  # rows are not copies of each other
    assert (square[1:] != square[:-1]).float().mean() == pytest.approx(0.5, abs=0.01)


def test_native_dropout_scales_the_kept_values_and_matches_aten_at_the_edges():
    torch.manual_seed(0)
    x = torch.randn(300, 400)
    out, keep = native_dropout(x, 0.25, True)
    torch.testing.assert_close(out, x * keep / 0.75)
    assert 0.7 < keep.float().mean().item() < 0.8
    for p, train in ((0.0, True), (0.3, False)):  # identity, like aten
        out, keep = native_dropout(x, p, train)
        torch.testing.assert_close(out, x)
        assert keep.all()
    out, keep = native_dropout(x, 1.0, True)
    assert not out.any() and not keep.any()


def test_decomposition_table_holds_the_cpu_dropout():
    table = decompositions()
    assert table[torch.ops.aten.native_dropout.default] is native_dropout
    assert len(DropoutTag().uuid()) == 32  # a sha256: part of inductor's cache keys


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:comera backend")
def test_compiled_dropout_hashes_masks_with_exact_gradients():
    """Under the backend the mask is hashed from two random keys (no bernoulli, no random
    buffer of the input's size), keeps ~90%, and the gradient is the mask scaled by
    1 / (1 - p), as aten's dropout backward gives."""
    from torch.profiler import profile

    def forward(x):
        return F.dropout(x, 0.1, training=True) * 2.0

    compiled = torch.compile(forward, backend="comera")
    x = torch.randn(256, 512, requires_grad=True)
    compiled(x).sum().backward()  # compile outside the profile
    x.grad = None
    with profile() as prof:
        out = compiled(x)
        out.sum().backward()
    keys = {e.key for e in prof.key_averages()}
    assert "aten::randint" in keys and "aten::bernoulli_" not in keys
    keep = out != 0
    assert keep.float().mean().item() == pytest.approx(0.9, abs=0.01)
    torch.testing.assert_close(out, x.detach() * keep * 2.0 / 0.9)
    torch.testing.assert_close(x.grad, keep * 2.0 / 0.9)


@pytest.mark.filterwarnings("ignore:comera backend")
def test_backend_hands_inductor_the_cpu_dropout_unless_the_user_owns_the_tag_slot(monkeypatch):
    """The tag rides in ``post_grad_custom_post_pass``; a user's own pass there wins, and
    then the graph keeps aten's dropout (the caches could not tell the two apart)."""
    import torch._inductor.compile_fx as inductor
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class Mine(CustomGraphPass):
        def __call__(self, graph):
            pass

        def uuid(self):
            return b"mine"

    calls = []

    def fake_compile_fx(gm, example_inputs, config_patches=None, decompositions=None, **_):
        calls.append((config_patches, decompositions))
        return gm.forward

    monkeypatch.setattr(inductor, "compile_fx", fake_compile_fx)

    def forward(x):  # in place: the graph keeps aten's call, and the table hashes it
        return F.dropout(x, 0.1, training=True, inplace=True)

    x = torch.randn(8, 8)
    torch.compile(forward, backend="comera")(x)
    config, table = calls[-1]
    assert isinstance(config["post_grad_custom_post_pass"], DropoutTag)
    assert table[torch.ops.aten.native_dropout.default] is native_dropout
    torch._dynamo.reset()
    torch.compile(forward, backend="comera",
                  options={"post_grad_custom_post_pass": Mine()})(x)
    config, table = calls[-1]
    assert isinstance(config["post_grad_custom_post_pass"], Mine) and table is None


@pytest.mark.parametrize("forward, drops", [
    (lambda x: F.dropout(x, 0.1, training=True), True),
    (lambda x: F.dropout(x, 0.1, training=True, inplace=True), True),
    (lambda x: torch.nn.functional.scaled_dot_product_attention(x, x, x, dropout_p=0.1), True),
    (lambda x: torch.nn.functional.scaled_dot_product_attention(x, x, x, dropout_p=0.0), False),
    (lambda x: torch.relu(x @ x), False),
])
def test_only_graphs_that_may_drop_out_get_the_dropout_table(forward, drops):
    from comera_compile.compile.cpu.dropout import may_drop_out

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(forward, backend=capture)(torch.randn(2, 4, 8, 8))
    assert may_drop_out(graphs[0]) is drops
    torch._dynamo.reset()


@pytest.mark.parametrize("p, drops", [(0.1, True), (0.0, False)])
def test_a_call_passing_dropout_p_positionally_may_drop_out(p, drops):
    """The absorbed attention (put in by the backend) takes ``dropout_p`` by position."""
    from comera_compile.compile.cpu.dropout import may_drop_out

    def attend(x, scale=1.0, dropout_p=0.0):
        return F.dropout(x * scale, dropout_p)

    graph = torch.fx.Graph()
    graph.output(graph.call_function(attend, (graph.placeholder("x"), 1.0, p)))
    assert may_drop_out(torch.fx.GraphModule(torch.nn.Module(), graph)) is drops


def test_out_of_place_dropout_is_hashed_before_tracing_and_its_graph_is_cached():
    """``F.dropout`` (what ``nn.Dropout`` calls) is pointed at the hashed dropout in the
    dynamo graph, so no table is handed to inductor and a second compile is a cache hit;
    the mask is still hashed (the forward's kept share) and the gradient is its mask."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_cache

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Dropout(0.25))
    x = torch.randn(256, 64)
    with fresh_cache():
        for _ in range(2):
            torch._dynamo.reset()
            counters.clear()
            torch.manual_seed(3)
            out = torch.compile(model, backend="comera")(x)
            out.sum().backward()
        assert counters["inductor"]["fxgraph_cache_hit"] == 2
        assert counters["inductor"]["fxgraph_cache_bypass"] == 0
    kept = out != 0
    assert abs(kept.float().mean().item() - 0.75) < 0.02
    dense = torch.nn.functional.linear(x, model[0].weight, model[0].bias)
    torch.testing.assert_close(out[kept], dense[kept] / 0.75)
    torch._dynamo.reset()


def test_compiled_graph_without_dropout_is_served_from_the_cache_in_a_new_compile():
    """A decomposition table handed to inductor keeps a graph out of its cache (an entry
    it cannot hash), so each new process compiled it from scratch; without dropout none is
    handed in, and a second compile of the same graph is a cache hit."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_cache

    from comera_compile.nn import TTLinear

    torch.manual_seed(0)
    model = torch.nn.Sequential(TTLinear(16, 32, ranks=2), torch.nn.GELU())
    x = torch.randn(4, 16)
    with fresh_cache():
        for _ in range(2):
            torch._dynamo.reset()
            counters.clear()
            out = torch.compile(model, backend="comera")(x)
            out.sum().backward()
        assert counters["inductor"]["fxgraph_cache_hit"] == 2  # forward and backward
        assert counters["inductor"]["fxgraph_cache_bypass"] == 0
    torch.testing.assert_close(out, model(x))
    torch._dynamo.reset()


def test_hashed_masks_keep_their_keys_and_per_element_draws_keep_their_mask():
    """``save_random_values`` saves the two keys of a hashed mask and marks the mask
    recomputed (nothing of the input's size is stored); for aten's dropout and for draws
    of one number per element it saves the smallest value read elsewhere, the mask."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils.checkpoint import CheckpointPolicy

    from comera_compile.compile.graph.recompute import save_random_values

    def marked(fn, shape, policy=CheckpointPolicy.MUST_SAVE):
        graph = make_fx(fn)(torch.randn(shape)).graph
        save_random_values(graph)
        return {n.target for n in graph.nodes if n.meta.get("recompute") == policy}

    ours = lambda x: native_dropout(x, 0.1, True)  # noqa: E731
    assert marked(ours, (6, 10)) == {torch.ops.aten.randint.low}  # the keys
    assert torch.ops.aten.ge.Scalar in marked(ours, (6, 10), CheckpointPolicy.MUST_RECOMPUTE)
    atens = marked(lambda x: torch.ops.aten.native_dropout.default(x, 0.1, True), (6, 10))
    assert atens == {torch.ops.aten.native_dropout.default}  # a random node of the input
    drawn = marked(lambda x: x * (torch.rand(x.shape) >= 0.1), (600, 500))  # 1.2 MB drawn
    assert drawn == {torch.ops.aten.ge.Scalar}  # the one-byte mask, not the 4-byte draws


def _saved_and_compiled(fn):
    """``fn`` under AOT autograd at a low budget; the values its forward saves."""
    from functorch.compile import aot_function, make_boxed_func

    from comera_compile.compile.graph.recompute import partition_keeping_random

    saved = []

    def forward_compiler(graph, _inputs):
        outputs = next(n for n in graph.graph.nodes if n.op == "output").args[0]
        saved.extend(n.meta["val"] for n in outputs[1:])
        return make_boxed_func(graph.forward)

    compiled = aot_function(fn, fw_compiler=forward_compiler,
                            bw_compiler=lambda g, _: make_boxed_func(g.forward),
                            partition_fn=partition_keeping_random)
    return saved, compiled


def test_low_memory_keeps_only_the_keys_of_hashed_masks_and_the_gradients_exact():
    """The hashed mask lives from forward to backward as its two keys, and backward's
    rehashed mask is the forward's, element for element (a wrong element would zero or keep
    the wrong gradient)."""
    saved, compiled = _saved_and_compiled(lambda x: native_dropout(x * 3.0, 0.25, True)[0])
    x = torch.randn(5, 37, requires_grad=True)
    with torch._functorch.config.patch(activation_memory_budget=0.05):
        out = compiled(x)
    assert [(v.dtype, v.numel()) for v in saved] == [(torch.int32, 2)]
    out.backward(torch.ones_like(out))
    kept = out != 0
    assert 0.6 < kept.float().mean() < 0.9
    torch.testing.assert_close(x.grad, kept * 3.0 / 0.75)


def test_low_memory_keeps_per_element_masks_as_bits_and_the_gradients_exact():
    """A mask drawn one number per element lives as one byte per eight elements
    (``pack_saved_masks``), and the gradient is still the forward's mask."""
    saved, compiled = _saved_and_compiled(
        lambda x: x * 3.0 * (torch.rand(x.shape) >= 0.25) / 0.75)
    x = torch.randn(513, 601, requires_grad=True)  # 308313 elements: the last byte padded
    with torch._functorch.config.patch(activation_memory_budget=0.05):
        out = compiled(x)
    assert [(v.dtype, v.numel()) for v in saved] == [(torch.uint8, 38540)]  # ceil(n / 8)
    out.backward(torch.ones_like(out))
    kept = out != 0
    assert 0.7 < kept.float().mean() < 0.8
    torch.testing.assert_close(x.grad, kept * 3.0 / 0.75)
