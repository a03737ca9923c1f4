"""The ``comera`` torch.compile backend on CPU: exact against eager (outputs and every
gradient), one plan per batch size, no graph breaks, the entry point in a fresh process,
options, and the captured train step."""

import logging
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

import comera_compile
import comera_compile.compile as cc
from comera_compile.cli.six_encoder import SixEncoderClassifier, SixEncoderConfig
from comera_compile.compile import backend as backend_module
from comera_compile.config import CompileOptions
from comera_compile.nn import TTEmbedding, TTLinear, TTMLinear
from comera_compile.training.pruning import prune_model


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def tensorize(module: nn.Module, ranks: int = 4) -> nn.Module:
    """Swap every nn.Linear for a TTLinear (random cores), in place."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            tt = TTLinear(
                child.in_features, child.out_features, ranks=ranks, bias=child.bias is not None
            )
            setattr(module, name, tt)
        else:
            tensorize(child, ranks)
    return module


def random_gates(model: nn.Module) -> None:
    """Gates away from 1 (and one switched off) so the gate folding is exercised too."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".gates." in name:
                p.uniform_(0.5, 1.5)
                p[0] = 0.0


def assert_matches_eager(model: nn.Module, compiled, *args, atol=1e-5, **kwargs) -> None:
    """Compiled and eager agree on the output and on the .grad of every parameter. The
    compile runs with inductor's caches off: a graph from a warm on-disk cache would be
    code compiled from an earlier version of the backend's passes, not this one."""

    def run(fn):
        model.zero_grad(set_to_none=True)
        out = fn(*args, **kwargs)
        out = out if isinstance(out, torch.Tensor) else out.logits
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return out.detach(), grads

    want, want_grads = run(model)
    with torch._inductor.config.patch(force_disable_caches=True):
        got, got_grads = run(compiled)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=atol)
    assert got_grads.keys() == want_grads.keys()
    assert len(got_grads) == sum(1 for _ in model.parameters())
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=atol, msg=name)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        TTLinear(64, 48, ranks=4),
        nn.GELU(),
        TTMLinear(48, 40, ranks=3),
        nn.Tanh(),
        TTLinear(40, 10, ranks=4, bias=False),
    )
    random_gates(model)
    return model


def six_encoder() -> SixEncoderClassifier:
    torch.manual_seed(0)
    config = SixEncoderConfig(
        vocab_size=1000, hidden=96, ffn=384, heads=4, layers=2, max_position=64, dropout=0.0
    )
    model = tensorize(SixEncoderClassifier(config))
    model.word_embeddings = TTEmbedding(1000, 96, ranks=8)
    return model


# ----- correctness ----------------------------------------------------------------------
def test_mlp_outputs_and_gradients_match_eager():
    model = mlp()
    compiled = torch.compile(model, backend="comera")
    assert_matches_eager(model, compiled, torch.randn(6, 64))


def test_each_batch_size_gets_its_own_plan():
    torch.manual_seed(0)
    layer = TTLinear(256, 256, ranks=8, in_modes=[4, 8, 8], out_modes=[8, 8, 4])
    compiled = cc.compile_model(layer)
    for rows in (2, 2048):
        x = torch.randn(rows, 256)
        torch.testing.assert_close(compiled(x), layer(x), rtol=1e-5, atol=1e-5)
    mine = {
        k[4]: plan
        for k, plan in cc.traced_plans().items()
        if k[:4] == ("tt", (4, 8, 8), (8, 8, 4), tuple(layer.ranks))
    }
    assert {2, 2048} <= mine.keys()
    small, large = mine[2], mine[2048]
    assert (small.rows_bucket, large.rows_bucket) == (2, 2048)
    # few rows: sweep the input through the cores; many rows: merge cores first
    assert small.order_expression() != large.order_expression()
    assert small.macs < large.macs


# Inductor's C++ codegen costs tens of seconds per model on a small CPU, so the large models
# check gradients with inductor=False (dynamo graph, our ops, AOT autograd, eager kernels)
# and the six-encoder's inductor kernels once, forward only.
AOT_ONLY = {"inductor": False}


def test_six_encoder_outputs_and_gradients_match_eager():
    model = six_encoder()
    random_gates(model)
    ids = torch.randint(0, 1000, (2, 16))
    types = torch.randint(0, 2, (2, 16))
    compiled = torch.compile(model, backend="comera", options=AOT_ONLY)
    assert_matches_eager(model, compiled, ids, types)


@pytest.mark.slow
def test_six_encoder_inductor_matches_eager():
    model = six_encoder().eval()
    random_gates(model)
    ids = torch.randint(0, 1000, (3, 16))
    compiled = cc.compile_model(model)
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-5, atol=1e-5)


def test_six_encoder_has_no_graph_break():
    model = six_encoder()
    explanation = torch._dynamo.explain(model)(torch.randint(0, 1000, (2, 16)))
    assert explanation.graph_break_count == 0
    assert explanation.graph_count == 1
    (graph,) = explanation.graphs
    assert len(cc.tensorized_nodes(graph)) == 2 * 6 + 2 + 1  # 6 a layer, fc1, fc2, embedding


def test_hugging_face_bert_outputs_and_gradients_match_eager():
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = tensorize(transformers.BertForSequenceClassification(config))
    random_gates(model)
    ids = torch.randint(0, 100, (2, 12))
    compiled = torch.compile(model, backend="comera", options=AOT_ONLY)
    assert_matches_eager(model, compiled, input_ids=ids)


# ----- options and the plain-graph fallback ---------------------------------------------
def test_objective_option_reaches_the_plans():
    model = mlp()
    compiled = torch.compile(
        model, backend="comera", options={"objective": "flops", "inductor": False}
    )
    x = torch.randn(5, 64)
    torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    first = model[0]
    objectives = {k[-1] for k in cc.traced_plans() if k[1:3] == (first.in_modes, first.out_modes)}
    assert "flops" in objectives
    assert first.objective == "combo"  # the option overrides the graph, not the layer


def test_bad_options_fail_at_the_door():
    with pytest.raises(ValueError, match="unknown comera backend options"):
        cc.compile_model(mlp(), cudagraph=True)
    with pytest.raises(ValueError, match="unknown objective"):
        cc.compile_model(mlp(), objective="fast")
    with pytest.raises(TypeError, match="must be a bool"):
        CompileOptions.from_backend_options({"autotune": "yes"})
    opts = CompileOptions.from_backend_options({"max_autotune": True}, mode="reduce-overhead")
    assert opts.cudagraphs is True and opts.inductor_config["max_autotune"] is True


def test_plain_graph_warns_once_and_still_compiles(monkeypatch):
    monkeypatch.setattr(backend_module, "_warned_plain", False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU())
    x = torch.randn(3, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            torch._dynamo.reset()
            out = torch.compile(model, backend="comera", options={"inductor": False})(x)
    torch.testing.assert_close(out, model(x))
    assert sum("no tensorized layer" in str(w.message) for w in caught) == 1


def test_a_cola_model_is_not_called_untensorized(monkeypatch):
    """CoLA and low-rank layers are plain matmuls (no op of ours in the graph); compiling
    them must not say the model is not tensorized."""
    monkeypatch.setattr(backend_module, "_warned_plain", False)
    torch.manual_seed(0)
    model = comera_compile.optimize(nn.Sequential(nn.Linear(64, 64), nn.ReLU(),
                                                  nn.Linear(64, 64)), 0.3, compile=False)
    assert {r["format"] for r in comera_compile.summary(model).records} == {"cola"}
    x = torch.randn(3, 64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch._dynamo.reset()
        out = torch.compile(model, backend="comera", options={"inductor": False})(x)
    torch.testing.assert_close(out, model(x))
    assert not any("no tensorized layer" in str(w.message) for w in caught)


def test_fresh_process_finds_the_backend():
    script = textwrap.dedent(
        """
        import warnings
        import torch
        assert "comera" in torch._dynamo.list_backends()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Tanh())
        x = torch.randn(3, 8)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = torch.compile(model, backend="comera", options={"inductor": False})(x)
        assert any("no tensorized layer" in str(w.message) for w in caught)
        print("maxdiff", float((out - model(x)).abs().max()))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.split("maxdiff")[1]) < 1e-6


# ----- the train step -------------------------------------------------------------------
def test_train_step_on_cpu_trains_and_follows_pruning():
    """On CPU the step is the compiled forward + eager backward and optimizer step (nothing
    is recorded: the CUDA Graph path is tested in test_compile_cuda.py)."""
    torch.manual_seed(0)
    model = nn.Sequential(TTLinear(64, 48, ranks=4), nn.GELU(), TTLinear(48, 10, ranks=4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-2, weight_decay=0.0)
    x = torch.randn(32, 64)
    y = torch.randint(0, 10, (32,))

    def loss_fn(m, batch):
        inputs, labels = batch
        return F.cross_entropy(m(inputs), labels)

    step = cc.capture_train_step(model, optimizer, loss_fn, (x, y))
    losses = [float(step((x, y))) for _ in range(10)]
    assert losses[-1] < 0.5 * losses[0]
    assert all(b < a for a, b in zip(losses, losses[1:]))
    # pruning shrinks parameters; the step keeps working at the new shapes
    with torch.no_grad():
        model[0].gates[1][:2] = 0.0
    pruned = prune_model(model, optimizer)  # AdamW's moments follow the cores
    assert list(pruned) == ["0"] and pruned["0"].total_removed == 2
    assert step.records == 0
    step.rerecord()
    with torch.no_grad():
        before = float(loss_fn(model, (x, y)))
    assert float(step((x, y))) == pytest.approx(before, rel=1e-5)
    with torch.no_grad():
        assert float(loss_fn(model, (x, y))) < before


def test_each_compiled_graph_logs_one_line(caplog):
    model = mlp()
    compiled = torch.compile(
        model, backend="comera", dynamic=False, options={"inductor": False}
    )
    with caplog.at_level(logging.INFO, logger="comera_compile"):
        for rows in (6, 6, 300):  # static shapes: one graph for 6 (run twice), one for 300
            compiled(torch.randn(rows, 64))
    lines = [r for r in caplog.records if "compiling a graph" in r.getMessage()]
    assert [r.name for r in lines] == ["comera_compile"] * 2
    assert "3 tensorized layer call(s), row bucket 8 " in lines[0].getMessage()
    assert "row bucket 512 " in lines[1].getMessage()


def test_sparse_table_left_dense_trains_compiled_with_sparse_gradients(caplog):
    """Inductor cannot compile a sparse gradient; a graph with a sparse=True lookup runs with
    AOT autograd and eager kernels instead, and its gradients are eager's, still sparse."""
    import logging

    class Clicks(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.EmbeddingBag(50, 8, mode="sum", sparse=True)
            self.head = nn.Linear(8, 1)

        def forward(self, ids):
            return self.head(self.table(ids)).squeeze(1)

    torch.manual_seed(0)
    model = Clicks()
    ids = torch.randint(0, 50, (6, 3), generator=torch.Generator().manual_seed(0))
    model(ids).sum().backward()
    eager = model.table.weight.grad.to_dense().clone()
    model.zero_grad(set_to_none=True)
    with caplog.at_level(logging.INFO, logger="comera_compile"):
        torch.compile(model, backend="comera")(ids).sum().backward()
    assert model.table.weight.grad.is_sparse
    torch.testing.assert_close(model.table.weight.grad.to_dense(), eager)
    assert any("sparse=True" in r.getMessage() for r in caplog.records)
