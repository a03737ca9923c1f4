"""Bond recomputation (``CompressionConfig(recompute="bonds")``): recomputed blocks give the
gradients a saved step gives, dropout included; what a step keeps, counted in bytes; CoLA's
own backward keeps only its input and bond; the lean causal-LM loss matches Hugging Face's."""

from __future__ import annotations

import copy

import hf_models
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import comera_compile as cc
from comera_compile.compile import bond_recompute
from comera_compile.compile.bond_recompute import recompute_bonds, recomputed_blocks
from comera_compile.compile.policy.blocks import repeated_blocks
from comera_compile.nn import CoLALinear, TTEmbedding
from comera_compile.training.causal_loss import (
    causal_lm_loss,
    drop_lean_causal_loss,
    use_lean_causal_loss,
)

DROPOUT_FIELDS = ("attention_dropout", "hidden_dropout_prob", "attention_probs_dropout_prob",
                  "resid_pdrop", "embd_pdrop", "attn_pdrop")


def hf_model(name: str, dropout: float = 0.2):
    """A tiny compressed Hugging Face model (saved: no recomputation) with dropout on."""
    build, _, loss_fn = hf_models.HF_MODELS[name]()
    torch.manual_seed(0)
    dense = build()
    for field in DROPOUT_FIELDS:  # the config's dropout as the modules read it
        if hasattr(dense.config, field):
            setattr(dense.config, field, dropout)
    for module in dense.modules():
        if isinstance(module, nn.Dropout):
            module.p = dropout
        if hasattr(module, "attention_dropout") and isinstance(module.attention_dropout, float):
            module.attention_dropout = dropout
        if hasattr(module, "dropout") and isinstance(module.dropout, float):
            module.dropout = dropout
    config = cc.CompressionConfig(budget=0.3, compile=False, recompute=None)
    model = cc.optimize(dense, config).train()
    return model, {"input_ids": hf_models.ids((4, 24))}, loss_fn


def gradients(model: nn.Module, inputs: dict, loss_fn, seed: int = 1):
    torch.manual_seed(seed)
    loss = loss_fn(model(**inputs).logits)
    return [g for g in torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)]


def assert_close(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is not None:
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_recomputed_blocks_give_the_saved_gradients_with_dropout_on(name):
    saved, inputs, loss_fn = hf_model(name)
    recomputed = copy.deepcopy(saved)
    assert recompute_bonds(recomputed) == 2  # both layers of the tiny model
    expected = gradients(saved, inputs, loss_fn)
    assert_close(gradients(recomputed, inputs, loss_fn), expected)
    # dropout is really on: another seed draws other masks and other gradients
    other = gradients(saved, inputs, loss_fn, seed=2)
    assert max((a - b).abs().max() for a, b in zip(other, expected) if a is not None) > 1e-4


class BlockBytes:
    """Bytes the blocks of a step keep for backward: inside a block, what autograd's
    saved-tensor hooks see (each storage once, parameters not counted); for a recomputed
    block, what its checkpoint holds itself instead (its input and its cached bond
    outputs), which never passes those hooks."""

    def __init__(self, model: nn.Module, monkeypatch) -> None:
        self.storages: dict[int, int] = {}
        self.bond_storages: list = []
        self.inside = False
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        for block in repeated_blocks(model):
            block.register_forward_pre_hook(lambda *a: setattr(self, "inside", True))
            block.register_forward_hook(lambda *a: setattr(self, "inside", False))
        original, call = bond_recompute._contexts, bond_recompute.RecomputedForward.__call__

        def contexts():
            forward_ctx, recompute_ctx = original()
            self.bond_storages.append(forward_ctx.storage)
            return forward_ctx, recompute_ctx

        def counting_call(this, *args, **kwargs):
            self.note(args[0] if args else kwargs["hidden_states"])  # the block's input
            return call(this, *args, **kwargs)

        monkeypatch.setattr(bond_recompute, "_contexts", contexts)
        monkeypatch.setattr(bond_recompute.RecomputedForward, "__call__", counting_call)

    def note(self, t: torch.Tensor) -> None:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.params:
            self.storages[ptr] = t.untyped_storage().nbytes()

    def bond_bytes(self) -> int:
        """Bytes of the outputs the checkpoints cached (an op's entry: its output, or a
        tuple of them)."""
        cached = [entry for storage in self.bond_storages for entries in storage.values()
                  for entry in entries.values()]
        flat = [e for entry in cached for e in (entry if isinstance(entry, tuple) else [entry])]
        return sum(e.val.untyped_storage().nbytes() for e in flat
                   if isinstance(getattr(e, "val", None), torch.Tensor))

    def kept(self, forward) -> int:
        def pack(t: torch.Tensor) -> torch.Tensor:
            if self.inside:
                self.note(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            self.output = forward()
        return sum(self.storages.values()) + self.bond_bytes()


def test_recomputation_keeps_the_block_inputs_and_bonds_only(monkeypatch):
    build, _, _ = hf_models.llama()
    torch.manual_seed(0)
    config = cc.CompressionConfig(budget=0.3, compile=False, recompute=None)
    saved = cc.optimize(build(), config).train()
    recomputed = copy.deepcopy(saved)
    recompute_bonds(recomputed)
    inputs = {"input_ids": hf_models.ids((8, 64))}
    rows, hidden = 8 * 64, saved.config.hidden_size

    saved_bytes = BlockBytes(saved, monkeypatch).kept(lambda: saved(**inputs).logits)
    counter = BlockBytes(recomputed, monkeypatch)
    kept = counter.kept(lambda: recomputed(**inputs).logits)
    # exactly: each block's input, its attention's output and log-sum-exp, and one
    # rows x rank float32 bond per CoLA layer
    layers = [m for m in recomputed.modules() if isinstance(m, CoLALinear)]
    bonds = sum(rows * _padded_rank(layer, rows) * 4 for layer in layers)
    attention = rows * hidden * 4 + rows * saved.config.num_attention_heads * 4
    assert counter.bond_bytes() == bonds + 2 * attention
    assert kept == bonds + 2 * attention + 2 * rows * hidden * 4
    assert kept < 0.15 * saved_bytes, (kept, saved_bytes)


def _padded_rank(layer: CoLALinear, rows: int) -> int:
    from comera_compile.planner.alignment import bond_padding

    (extra,) = bond_padding(list(layer.cores), rows)
    return layer.rank + extra


def test_cola_backward_keeps_its_input_and_the_pre_activation_bond():
    torch.manual_seed(0)
    layer = CoLALinear(96, 160, ranks=24)
    x = torch.randn(4, 300, 96, requires_grad=True)
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    sizes: list[int] = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in params and t.dim() >= 2:
            sizes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    rows = 4 * 300
    rank = _padded_rank(layer, rows)
    # the input and z = x U: nothing else of the rows' width or the bond's
    assert sorted(sizes)[-2:] == sorted([rows * 96 * 4, rows * rank * 4])
    assert sum(s for s in sizes if s >= rows * 4) == rows * (96 + rank) * 4
    # and the gradients are autograd's of the same formula
    u, v = layer.cores
    gate = F.hardshrink(layer.gates[0], layer.threshold)
    reference = (F.silu(x @ u.reshape(96, -1)) * gate) @ v.reshape(-1, 160) + layer.bias
    g = torch.randn_like(y)
    wrt = [x, *layer.parameters()]
    for a, b in zip(torch.autograd.grad(y, wrt, g), torch.autograd.grad(reference, wrt, g)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def encoder(dropout: float = 0.2):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 256, dropout=dropout, batch_first=True)
    return nn.Sequential(nn.Linear(16, 64), nn.TransformerEncoder(layer, 3,
                                                                  enable_nested_tensor=False))


def test_plain_module_recomputes_with_dropout_on():
    x = torch.randn(4, 32, 16)
    config = cc.CompressionConfig(budget=0.4, compile=False, recompute=None)
    saved = cc.optimize(encoder(), config, example_inputs=(x,)).train()
    recomputed = copy.deepcopy(saved)
    assert recompute_bonds(recomputed) == 3

    def grads(model, seed=1):
        torch.manual_seed(seed)
        return torch.autograd.grad(model(x).square().mean(), list(model.parameters()))

    expected = grads(saved)
    assert_close(list(grads(recomputed)), list(expected))
    assert max((a - b).abs().max() for a, b in zip(grads(saved, 2), expected)) > 1e-4


def test_option_is_checked_and_survives_save_and_load(tmp_path):
    with pytest.raises(ValueError, match="recompute must be one of"):
        cc.CompressionConfig(recompute="all")
    build, inputs, loss_fn = hf_models.llama()
    torch.manual_seed(0)
    config = cc.CompressionConfig(budget=0.3, compile=False, recompute="bonds")
    model = cc.optimize(build(), config)
    assert recomputed_blocks(model) == 2 and cc.config_of(model).recompute == "bonds"
    assert model.loss_function is causal_lm_loss
    cc.save(model, tmp_path)
    loaded = cc.load(tmp_path)
    assert recomputed_blocks(loaded) == 2 and cc.config_of(loaded).recompute == "bonds"
    assert_close(gradients(loaded, inputs, loss_fn), gradients(model, inputs, loss_fn))
    bond_recompute.stop_recomputing(loaded)
    assert recomputed_blocks(loaded) == 0
    assert "_loss_function" not in loaded.__dict__


@pytest.mark.parametrize("vocab_dtype", [torch.float32, torch.float64])
def test_lean_causal_loss_matches_hugging_face(vocab_dtype):
    from transformers.loss.loss_utils import ForCausalLMLoss

    torch.manual_seed(0)
    logits = torch.randn(3, 700, 50, dtype=vocab_dtype, requires_grad=True)
    labels = torch.randint(0, 50, (3, 700))
    labels[0, :5] = -100
    for items in (None, torch.tensor(1500)):
        expected = ForCausalLMLoss(logits.float(), labels, 50, num_items_in_batch=items)
        loss = causal_lm_loss(logits, labels, 50, num_items_in_batch=items)
        torch.testing.assert_close(loss.float(), expected, rtol=1e-6, atol=1e-6)
        (a,) = torch.autograd.grad(loss * 3, logits)
        (b,) = torch.autograd.grad(expected * 3, logits)
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("head_kind", ["linear", "linear-bias", "cola"])
def test_head_recomputing_loss_matches_hugging_face(head_kind, monkeypatch):
    """Logits tagged by the output head: the loss keeps the head's narrow input, remakes the
    logits in blocks in backward (several blocks here), and gives Hugging Face's value and
    gradients of the head's parameters and input, ignored labels included."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    from comera_compile.training import causal_loss

    monkeypatch.setattr(causal_loss, "BLOCK_ELEMENTS", 300)  # 6 rows of 50 logits a block
    torch.manual_seed(0)
    if head_kind == "cola":
        head = CoLALinear(16, 50, ranks=8)
        with torch.no_grad():
            head.gates[0][2] = 0.0  # an off gate entry stays off
    else:
        head = nn.Linear(16, 50, bias=head_kind == "linear-bias")
    assert causal_loss.tag_head_outputs(head)
    x = torch.randn(3, 41, 16, requires_grad=True)
    labels = torch.randint(0, 50, (3, 41))
    labels[1, :7] = -100
    logits = head(x)
    assert logits._comera_head[0] is head
    loss = causal_lm_loss(logits, labels, 50)
    assert loss.grad_fn.next_functions[0][0].name() == "_HeadCrossEntropySumBackward"
    expected = ForCausalLMLoss(logits.detach().requires_grad_(), labels, 50)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    wrt = [x, *head.parameters()]
    factors = (3.0, -3.0)  # a negative upstream gradient cannot ride on the exponent's shift
    got = [torch.autograd.grad(loss * f, wrt, allow_unused=True, retain_graph=True)
           for f in factors]
    causal_loss.untag_head_outputs(head)
    assert not hasattr(head(x), "_comera_head")
    for f, grads in zip(factors, got):
        want = torch.autograd.grad(ForCausalLMLoss(head(x), labels, 50) * f, wrt,
                                   allow_unused=True)
        for a, b in zip(grads, want):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_head_recomputing_loss_frees_the_logits():
    """A Hugging Face LLaMA with the lean loss: once the caller keeps only ``.loss``, nothing
    as large as the logits stays alive for backward."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=4000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False,
        use_cache=False))
    tokens = torch.randint(0, 4000, (2, 64))
    logits_bytes = 2 * 64 * 4000 * 4
    assert use_lean_causal_loss(model)
    saved: list[int] = [0]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            saved.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=tokens, labels=tokens).loss
    assert max(saved) < logits_bytes / 8
    loss.backward()
    lean = [p.grad.clone() for p in model.parameters()]
    drop_lean_causal_loss(model)
    model.zero_grad()
    model(input_ids=tokens, labels=tokens).loss.backward()
    for a, p in zip(lean, model.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["comera", "inductor"])
def test_compiled_recomputation_gives_eager_gradients(backend):
    saved, inputs, loss_fn = hf_model("llama", dropout=0.0)
    recomputed = copy.deepcopy(saved)
    recompute_bonds(recomputed)
    compiled = torch.compile(recomputed, backend=backend)
    assert_close_loose(gradients(compiled, inputs, loss_fn), gradients(saved, inputs, loss_fn))


def assert_close_loose(a: list, b: list) -> None:
    for x, y in zip(a, b):
        if x is not None:
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)


def kept_by_forward(model: nn.Module, inputs: dict) -> int:
    """Bytes ``model``'s forward saves for backward through autograd's hooks (a compiled
    graph saves what its partitioner keeps that way), parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(**inputs).logits
    logits.float().square().mean().backward()
    return sum(storages.values())


@pytest.mark.slow
def test_optimize_option_keeps_less_in_the_compiled_graph():
    """``optimize(compile="always", recompute="bonds")``: the compiled graph keeps what the
    policy says, a fraction of what the same graph keeps without recomputation."""
    torch._dynamo.reset()
    build, _, _ = hf_models.llama()
    inputs = {"input_ids": hf_models.ids((8, 64))}
    kept = {}
    for recompute in (None, "bonds"):
        torch.manual_seed(0)
        dense = build()
        dense.config.tie_word_embeddings = False
        config = cc.CompressionConfig(budget=0.3, compile="always", recompute=recompute)
        model = cc.optimize(dense, config, example_inputs=(inputs["input_ids"],))
        kept_by_forward(model, inputs)  # compiles
        kept[recompute] = kept_by_forward(model, inputs)
    # (the tied head's TT chain outside the blocks keeps the same in both)
    assert kept["bonds"] < 0.7 * kept[None], kept


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False,
        use_cache=False))


def test_auto_recomputes_where_activations_outweigh_the_parameter_state(tmp_path):
    """``recompute="auto"`` (the default): bonds where one step on the example batch keeps
    more than the weights, gradients and AdamW moments weigh, none where it keeps less; the
    report records the decision and a saved model loads back with it."""
    from comera_compile.compile.bond_recompute import kept_bytes

    few = torch.zeros(1, 4, dtype=torch.long)
    many = torch.zeros(16, 128, dtype=torch.long)
    small = cc.optimize(_tiny_llama(), budget=0.25, compile=False, example_inputs=(few,))
    large = cc.optimize(_tiny_llama(), budget=0.25, compile=False, example_inputs=(many,))
    state = 16 * sum(p.numel() for p in small.parameters())
    assert kept_bytes(small, (few,)) < state < kept_bytes(large, (many,))
    assert (recomputed_blocks(small), recomputed_blocks(large)) == (0, 2)
    assert cc.config_of(large).recompute == "auto"
    assert cc.passes.report_of(large).recompute == "bonds"
    assert cc.passes.report_of(small).recompute is None
    assert "recompute: bonds" in str(cc.summary(large))
    assert "recompute:" not in str(cc.summary(small))
    # a count over the first row, scaled: what the full batch keeps, without holding it
    four = torch.zeros(4, 128, dtype=torch.long)
    assert kept_bytes(large, (four,)) == 4 * kept_bytes(large, (four[:1],))
    cc.save(large, tmp_path / "large")
    assert recomputed_blocks(cc.load(tmp_path / "large")) == 2
    cc.save(small, tmp_path / "small")
    assert recomputed_blocks(cc.load(tmp_path / "small")) == 0
    # no CoLA bonds in the stacks (low rank from scratch): nothing to keep narrow
    lowrank = cc.optimize(_tiny_llama(), budget=0.25, format="lowrank", compile=False,
                          example_inputs=(many,))
    assert recomputed_blocks(lowrank) == 0
    # without example inputs there is no batch to weigh: autograd keeps what it keeps
    assert recomputed_blocks(cc.optimize(_tiny_llama(), budget=0.25, compile=False)) == 0


def test_a_recomputed_lookup_keeps_only_the_ids_and_gives_the_same_gradients(monkeypatch):
    """``TTEmbedding.recompute_lookup`` (set by bond recomputation): the lookup's partial
    products, many times wider than its rows, are built again in backward; the gradients of
    the cores and gates are those of the saved lookup."""
    from comera_compile.nn import tt_embedding

    monkeypatch.setattr(tt_embedding, "RECOMPUTED_IDS", 50)  # several blocks of ids
    torch.manual_seed(0)
    table = TTEmbedding(1000, 64, ranks=16)
    ids = torch.randint(0, 1000, (8, 40))
    weight = torch.randn(8, 40, 64)

    def run(recompute: bool) -> tuple[list, int]:
        table.recompute_lookup = recompute
        table.zero_grad()
        params = {p.untyped_storage().data_ptr() for p in table.parameters()}
        kept: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.untyped_storage().data_ptr() not in params:
                kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = table(ids)
        (out * weight).sum().backward()
        return [p.grad.clone() for p in table.parameters()], sum(kept.values())

    saved_grads, saved_bytes = run(False)
    recomputed_grads, recomputed_bytes = run(True)
    for a, b in zip(recomputed_grads, saved_grads):  # blocks of ids: sums in another order
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))
    assert recomputed_bytes * 4 < saved_bytes  # ids and indices, not rank-wide products
    model = nn.Sequential(table, nn.ModuleList([nn.Linear(4, 4)]))
    table.__dict__.pop("recompute_lookup")
    recompute_bonds(model)  # no stack of blocks holding compressed layers: nothing changes
    assert not table.recompute_lookup


def test_kept_bytes_counts_a_batch_whose_inputs_do_not_all_lead_with_it():
    """Inputs whose first dims are not all the batch (here a square mask the model checks
    against the batch): the first-row count cannot run, so the batch is counted whole."""
    from comera_compile.compile.bond_recompute import kept_bytes

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            if mask.shape != (x.shape[0], x.shape[0]):
                raise ValueError("the mask must be batch x batch")
            return torch.tanh(self.lin(x)) * mask.sum(1, keepdim=True)

    model = Masked()
    x, mask = torch.randn(4, 8), torch.ones(4, 4)
    kept = kept_bytes(model, (x, mask))
    assert kept > 0 and model.training  # counted; the mode is as it was
    model.eval()
    assert kept_bytes(model, (x, mask)) == kept and not model.training


def test_kept_bytes_leaves_no_graph_behind():
    """The count runs a forward with grad on and no backward: none of its activations may
    outlive it (a saved output packed as itself would keep the whole graph alive through a
    cycle the collector cannot see)."""
    import gc
    import weakref

    from comera_compile.compile.bond_recompute import kept_bytes

    model = cc.optimize(_tiny_llama(), budget=0.25, compile=False)
    outputs: list[weakref.ref] = []
    for block in model.model.layers:
        block.post_attention_layernorm.register_forward_hook(
            lambda m, a, out: outputs.append(weakref.ref(out)))
    assert kept_bytes(model, (torch.zeros(2, 16, dtype=torch.long),)) > 0
    gc.collect()
    assert len(outputs) == 2 and all(ref() is None for ref in outputs)
