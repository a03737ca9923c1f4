"""Budget spending and rank allocation: 95-100% of the budget on real transformer shapes, the
error-aware objective against the uniform rank on matrices of known spectra, FLOPs budgets
counted by torch's own FlopCounterMode, and what the summary says about each layer."""

import warnings

import pytest
import torch
from models import MLP
from torch import nn
from torch.utils.flop_counter import FlopCounterMode
from transformers import (
    BertConfig,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

import comera_compile.api as cc
from comera_compile.passes import Budget, find_candidates
from comera_compile.passes.allocate import uniform_ranks
from comera_compile.passes.eligible import eligible_options
from comera_compile.passes.select import select_layers
from comera_compile.passes.spectra import layer_spectrum, output_weights, relative_error


def n_params(model):
    return sum(p.numel() for p in model.parameters())


def bert():
    return BertModel(BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=256, vocab_size=2000,
                                max_position_embeddings=128))


def gpt2():  # untied: a tied table is kept dense whole, so 40x would be out of reach
    return GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=2000,
                                      n_positions=128, bos_token_id=0, eos_token_id=0,
                                      tie_word_embeddings=False))


def llama():
    return LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=344,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=2000,
                                        max_position_embeddings=128))


FAMILIES = {"bert": bert, "gpt2": gpt2, "llama": llama}
BUDGETS = [0.5, 0.2, 0.05, Budget(ratio=10), Budget(ratio=40)]


def _share(budget):
    return budget if isinstance(budget, float) else 1 / budget.ratio


def _select(model, budget, init="random", **kwargs):
    options, skipped = eligible_options(find_candidates(model), None, None,
                                        kwargs.get("include"), None, None, None, "tt", None)
    params = n_params(model)
    before = {"params": params, "bytes": 4 * params, "macs": None}
    return select_layers(options, skipped, budget, before, None, init)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_budget_spent_within_five_percent_on_transformers(family):
    torch.manual_seed(0)
    model = FAMILIES[family]()
    for budget in BUDGETS:
        sel = _select(model, budget if isinstance(budget, Budget) else Budget(fraction=budget))
        share = sel.after["params"] / sel.before["params"]
        assert 0.95 * _share(budget) <= share <= _share(budget), (budget, share)
    # and the built model holds what the selection counted
    ids = torch.randint(0, 2000, (2, 8))
    built = cc.optimize(model, Budget(ratio=10), example_inputs=ids, compile=False)
    assert 0.95 / 10 <= n_params(built) / n_params(model) <= 1 / 10


def test_ranks_exceed_thirty_when_the_budget_allows():
    model = MLP((1024, 1024, 1024, 10))
    sel = _select(model, Budget(fraction=0.3))
    assert max(max(spec.ranks) for _, spec in sel.chosen.values()) > 30
    assert 0.95 * 0.3 <= sel.after["params"] / sel.before["params"] <= 0.3


def test_random_init_compresses_layers_alike():
    model = MLP((256, 1024, 512, 10))
    sel = _select(model, Budget(fraction=0.1))
    ratios = [cand.dense_params / spec.params for cand, spec in sel.chosen.values()]
    assert len(ratios) == 2 and max(ratios) / min(ratios) < 1.3


def _linear_with_spectrum(values, seed):
    """A square Linear whose singular values are ``values`` (random singular vectors)."""
    g, n = torch.Generator().manual_seed(seed), len(values)
    u, _ = torch.linalg.qr(torch.randn(n, n, generator=g))
    v, _ = torch.linalg.qr(torch.randn(n, n, generator=g))
    layer = nn.Linear(n, n, bias=False)
    layer.weight.data = u @ torch.diag(values) @ v.T
    return layer


def _built_errors(model, budget, max_rank=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = cc.optimize(model, cc.CompressionConfig(budget=budget, max_rank=max_rank),
                          init="dense", compile=False)
    errors = {r["name"]: r["error"] for r in cc.summary(out).records}
    return out, errors


def test_error_aware_allocation_beats_uniform_rank_at_equal_params():
    i = torch.arange(64, dtype=torch.float32)
    model = nn.Sequential(  # fast and slow decay: the best ranks differ a lot
        _linear_with_spectrum(0.6**i, 0), _linear_with_spectrum(1 / (1 + i), 1),
    )
    uniform, uniform_err = _built_errors(model, None, max_rank=6)
    aware, aware_err = _built_errors(model, Budget(params=n_params(uniform)))
    assert n_params(aware) <= n_params(uniform)
    total_uniform = sum(e**2 for e in uniform_err.values())
    total_aware = sum(e**2 for e in aware_err.values())
    assert total_aware < 0.8 * total_uniform, (aware_err, uniform_err)


def test_spectrum_bound_matches_the_built_error():
    i = torch.arange(64, dtype=torch.float32)
    model = nn.Sequential(_linear_with_spectrum(0.8**i, 3))
    out, errors = _built_errors(model, None, max_rank=5)
    (cand,) = find_candidates(model)
    options, _ = eligible_options([cand], None, None, None, None, None, None, "tt", None)
    spec = options[0].spec(5)
    predicted = layer_spectrum(cand, spec).relative_sq_error(spec.ranks) ** 0.5
    assert errors["0"] <= predicted + 1e-4  # TT-SVD error never exceeds the sum of the tails
    assert errors["0"] >= 0.5 * predicted


class _TableAndMLP(nn.Module):
    """A table with a flat spectrum (rows of noise) feeding layers that compress well."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Embedding(4096, 64)
        self.a = _linear_with_spectrum(0.9 ** torch.arange(256.0), 4)
        self.b = _linear_with_spectrum(0.9 ** torch.arange(256.0), 5)

    def forward(self, ids):
        x = self.table(ids).repeat(1, 1, 4)
        return self.b(torch.relu(self.a(x)))


def test_high_error_table_stays_dense_unless_forced():
    model = _TableAndMLP()
    sel = _select(model, Budget(fraction=0.9), init="dense")
    assert "table" not in sel.chosen and "kept dense" in sel.skipped["table"]
    assert {"a", "b"} <= set(sel.chosen)
    assert 0.95 * 0.9 <= sel.after["params"] / sel.before["params"] <= 0.9
    forced = _select(model, Budget(fraction=0.9), init="dense", include=["table", "a", "b"])
    assert "table" in forced.chosen


def test_dense_init_warns_and_summary_shows_error_and_share():
    model = _TableAndMLP()
    with pytest.warns(UserWarning, match="relative error"):
        out = cc.optimize(model, Budget(fraction=0.05), init="dense", compile=False)
    records = {r["name"]: r for r in cc.summary(out).records}
    assert records["table"]["error"] > 0.5
    cand = {c.name: c for c in find_candidates(model)}["a"]
    assert records["a"]["error"] == pytest.approx(relative_error(cand, out.a), abs=1e-6)
    limit = 0.05 * n_params(model)
    for record in records.values():
        assert record["budget_share"] == pytest.approx(record["params_after"] / limit)
    assert "error" in str(cc.summary(out)) and "budget" in str(cc.summary(out))


def test_output_weights_see_which_directions_inputs_excite():
    i = torch.arange(64, dtype=torch.float32)
    layer = _linear_with_spectrum(0.9**i, 6)
    model = nn.Sequential(layer)
    cands = find_candidates(model)
    isotropic = output_weights(model, torch.randn(4096, 64), cands)["0"]
    assert isotropic == pytest.approx(1.0, rel=0.1)
    _, _, vh = torch.linalg.svd(layer.weight.detach())
    along_top = torch.randn(256, 1) * vh[:1]  # inputs on the strongest direction only
    assert output_weights(model, along_top, cands)["0"] < 0.2


class _TableAndLinears(nn.Module):
    """A 50000 x 256 table and two 256 x 1024 layers: the table holds 96% of the parameters
    and none of the multiply-adds."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50000, 256)
        self.up = nn.Linear(256, 1024)
        self.down = nn.Linear(1024, 256)

    def forward(self, ids):
        return self.down(torch.relu(self.up(self.emb(ids))))


def _torch_macs(model, x):
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(x)
    return counter.get_total_flops() // 2


@pytest.mark.parametrize("share", [0.5, 0.1])
def test_flops_budget_measured_by_flop_counter(share):
    torch.manual_seed(0)
    model, ids = _TableAndLinears(), torch.randint(0, 50000, (4, 32))
    dense = _torch_macs(model, ids)
    out = cc.optimize(model, Budget(flops=share), example_inputs=ids, compile=False)
    got = _torch_macs(out, ids)
    assert 0.95 * share * dense <= got <= share * dense
    assert isinstance(out.emb, nn.Embedding)  # a lookup saves no multiply-adds


def test_flops_budget_unreachable_only_when_it_is():
    model, ids = _TableAndLinears(), torch.randint(0, 50000, (4, 32))
    with pytest.raises(ValueError, match="multiply-adds"):
        cc.optimize(model, Budget(flops=1000), example_inputs=ids, compile=False)


def test_uniform_ranks_clip_every_bond():
    assert uniform_ranks((8, 8, 8, 8), 100) == (1, 8, 64, 8, 1)
    assert uniform_ranks((8, 8, 8, 8), 100, max_rank=10) == (1, 8, 10, 8, 1)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(4))
        self.head = nn.Linear(64, 64)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_copies_of_a_layer_in_repeated_blocks_are_tensorized_alike(monkeypatch):
    """Training from scratch, the budget's last share left one block's ``down`` dense:
    another shape than its copies, so a compiled graph of its own. Tied, every copy is
    tensorized and the budget is still spent (95-100%)."""
    from comera_compile.nn import TensorizedLayer
    from comera_compile.passes import select

    assert select.block_place("model.layers.3.mlp.up_proj") == "model.layers.*.mlp.up_proj"
    x = (torch.randn(8, 64),)
    dense = sum(p.numel() for p in _Blocks().parameters())
    model = cc.optimize(_Blocks(), budget=0.6, example_inputs=x, compile=False)
    for block in model.blocks:
        assert isinstance(block.up, TensorizedLayer) and isinstance(block.down, TensorizedLayer)
    params = sum(p.numel() for p in model.parameters())
    assert 0.95 * 0.6 * dense <= params <= 0.6 * dense
    monkeypatch.setattr(select, "_unlike_copies", lambda options, states: [])  # untied
    untied = cc.optimize(_Blocks(), budget=0.6, example_inputs=x, compile=False)
    assert "blocks.0.down" in cc.summary(untied).skipped


@pytest.mark.parametrize("build", [
    lambda: BertModel(BertConfig(vocab_size=100, hidden_size=128, num_hidden_layers=4,
                                 num_attention_heads=4, intermediate_size=256)),
    lambda: GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=128, n_layer=4, n_head=4)),
    lambda: LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=128,
                                         intermediate_size=256, num_hidden_layers=4,
                                         num_attention_heads=4)),
], ids=["bert", "gpt2", "llama"])
def test_hugging_face_blocks_are_tensorized_alike_within_the_budget(build):
    """On models we did not write, at a budget that leaves some layers dense: every place
    in the blocks is dense in all blocks or tensorized in all, 95-100% of the budget."""
    from comera_compile.nn import TensorizedLayer
    from comera_compile.passes.select import block_place

    torch.manual_seed(0)
    dense = build()
    before = sum(p.numel() for p in dense.parameters())
    model = cc.optimize(dense, budget=0.7, example_inputs=(torch.randint(0, 100, (2, 16)),),
                        compile=False)
    kinds: dict[str, set[tuple]] = {}
    for name, module in model.named_modules():
        place = block_place(name)
        if place != name and (isinstance(module, (nn.Linear, TensorizedLayer))
                              or type(module).__name__ == "Conv1D"):
            shapes = tuple(tuple(p.shape) for p in module.parameters())
            kinds.setdefault(place, set()).add((isinstance(module, TensorizedLayer), shapes))
    assert kinds and all(len(k) == 1 for k in kinds.values()), kinds  # kind and ranks alike
    assert any(tensorized for k in kinds.values() for tensorized, _ in k)
    params = sum(p.numel() for p in model.parameters())
    assert 0.95 * 0.7 * before <= params <= 0.7 * before


def test_copies_in_repeated_blocks_get_the_same_ranks(monkeypatch):
    """Hugging Face's LLaMA at budget 0.05: the budget's last rank increments gave three
    blocks' ``down_proj`` rank 14 and the fourth 13, another shape, so that block ran eager
    beside three compiled ones. Alike, the four blocks have one shape, and the budget is
    still spent (95-100%)."""
    from comera_compile.compile.policy.blocks import distinct_shapes, repeated_blocks
    from comera_compile.passes import select

    def build():
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(
            vocab_size=256, hidden_size=384, intermediate_size=1024, num_hidden_layers=4,
            num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128))

    x = (torch.randint(0, 256, (8, 128)),)
    before = sum(p.numel() for p in build().parameters())
    model = cc.optimize(build(), budget=0.05, example_inputs=x, compile=False)
    assert distinct_shapes(repeated_blocks(model), symbolic_ranks=False) == 1
    params = sum(p.numel() for p in model.parameters())
    assert 0.95 * 0.05 * before <= params <= 0.05 * before
    monkeypatch.setattr(select, "_alike_ranks", lambda options, plans, states, *_: states)
    unlike = cc.optimize(build(), budget=0.05, example_inputs=x, compile=False)
    assert distinct_shapes(repeated_blocks(unlike), symbolic_ranks=False) > 1
