"""Distillation: the loss helper, and the loop recovering a compressed model's outputs."""

import copy
import importlib
import types
import warnings

import pytest
import torch
from models import MLP
from torch import nn

import comera_compile.api as cc
from comera_compile.training import distill, distill_loss, fit_layers
from comera_compile.training.distill import compressed_layers

distill_module = importlib.import_module("comera_compile.training.distill")  # not the function


class FakeClock:
    """``time`` for the distill module: each reading is ``tick`` seconds after the last, so
    a time limit is spent after a known number of readings, whatever the machine."""

    def __init__(self, tick: float) -> None:
        self.now, self.tick, self.readings = 0.0, tick, 0

    def perf_counter(self) -> float:
        self.now += self.tick
        self.readings += 1
        return self.now


@pytest.fixture
def adam_steps(monkeypatch):
    """The parameters each Adam step of the fit updated (ids), one set per step."""
    steps: list[set[int]] = []

    class CountingAdam(torch.optim.Adam):
        def step(self, closure=None):
            steps.append({id(p) for group in self.param_groups for p in group["params"]})
            return super().step(closure)

    monkeypatch.setattr(torch.optim, "Adam", CountingAdam)
    return steps


def test_distill_loss_is_relative_and_only_trains_the_student():
    teacher = torch.randn(4, 8)
    student = (teacher + 0.1 * torch.randn(4, 8)).requires_grad_()
    loss = distill_loss(student, teacher)
    expected = ((student - teacher) ** 2).sum() / (teacher**2).sum()
    torch.testing.assert_close(loss, expected)
    assert distill_loss(teacher, teacher) == 0
    torch.testing.assert_close(distill_loss(3 * student, 3 * teacher), loss)
    loss.backward()
    torch.testing.assert_close(student.grad, 2 * (student - teacher) / (teacher**2).sum())


def test_distill_recovers_a_compressed_model():
    torch.manual_seed(0)
    teacher = MLP((32, 128, 32, 16)).eval()
    data = [torch.randn(64, 32) for _ in range(4)]
    held = torch.randn(256, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        student = cc.optimize(copy.deepcopy(teacher), 0.5, init="dense", inplace=True,
                              compile=False)
    weights = [p.detach().clone() for p in teacher.parameters()]

    def error():
        with torch.no_grad():
            return float(distill_loss(student(held), teacher(held)))

    before = error()
    losses = distill(student, teacher, data, steps=50, lr=1e-2, layers=["net.0"],
                     progress=False)
    assert len(losses) == 50 and sum(losses[-5:]) < 0.85 * sum(losses[:5])
    assert error() < 0.7 * before
    assert all(torch.equal(w, p) for w, p in zip(weights, teacher.parameters()))
    assert not student.training and not teacher.training  # modes given back


def test_distill_with_a_time_limit_passes_over_the_batches_until_the_time_is_spent(
        monkeypatch):
    torch.manual_seed(0)
    teacher = MLP((32, 64, 16)).eval()
    data = [torch.randn(8, 32) for _ in range(3)]
    student = copy.deepcopy(teacher)
    with torch.no_grad():
        student.net[0].weight.mul_(0.5)
    one_pass = distill(student, teacher, data, progress=False)
    assert len(one_pass) == 3  # neither steps nor a time limit: one pass
    clock = FakeClock(0.125)  # one reading at the start, one after each step
    monkeypatch.setattr(distill_module, "time", types.SimpleNamespace(
        perf_counter=clock.perf_counter))
    timed = distill(student, teacher, data, time_limit=0.5, progress=False)
    assert len(timed) == 5 and clock.now > 0.5  # past the 3 batches, until 0.625 > 0.5
    monkeypatch.undo()
    once = distill(student, teacher, iter(data), steps=7, progress=False)  # an iterator
    assert len(once) == 7


def test_distill_names_missing_submodules():
    teacher = MLP((64, 256, 64, 32))
    with pytest.raises(ValueError, match="inplace=True"):
        distill(copy.deepcopy(teacher), teacher, [torch.randn(2, 64)], layers=["nope"],
                progress=False)


class _Lookup(torch.nn.Module):
    """A table followed by a linear layer: one layer that sees ids, one that sees features."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(1000, 64)
        self.proj = torch.nn.Linear(64, 64)

    def forward(self, ids):
        return self.proj(self.table(ids))


def _compressed_lookup(share):
    torch.manual_seed(0)
    teacher = _Lookup().eval()
    with torch.no_grad():  # a linear layer whose inputs favour some directions
        teacher.table.weight.mul_(torch.linspace(1, 0.1, 64) ** 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = cc.CompressionConfig(budget=share, include=["table", "proj"])
        student = cc.optimize(copy.deepcopy(teacher), config, init="dense", inplace=True,
                              compile=False)
    return teacher, student


def test_fit_layers_lowers_each_layers_error_on_the_inputs_it_sees():
    teacher, student = _compressed_lookup(0.3)
    vocab = torch.randperm(1000)[:100]  # the text uses 100 of the 1000 rows, Zipf-like
    frequent = vocab[torch.multinomial(1 / torch.arange(1.0, 101), 4000, replacement=True)]
    data = [frequent[i : i + 200].view(20, 10) for i in range(0, 4000, 200)]
    dense_weights = [p.detach().clone() for p in teacher.parameters()]
    bias = student.proj.bias.detach().clone()

    def errors():
        with torch.no_grad():
            rows = distill_loss(student.table(frequent), teacher.table(frequent))
            x = teacher.table(frequent)
            out = distill_loss(student.proj(x) - student.proj.bias,
                               teacher.proj(x) - teacher.proj.bias)
            return float(rows), float(out)

    assert compressed_layers(student, teacher) == ["table", "proj"]
    rows0, out0 = errors()
    result = fit_layers(student, teacher, data, steps=60, lr=1e-2, sample=128,
                        progress=False)
    rows1, out1 = errors()
    assert rows0 > 0.5 and rows1 < 0.2 * rows0  # the rows the text uses are fitted
    assert out1 < 0.5 * out0  # the projection is fitted where its inputs are
    assert all(after < 0.5 * before for before, after in result.values())
    assert torch.equal(student.proj.bias, bias)  # biases and rank gates are left alone
    assert all(torch.equal(w, p) for w, p in zip(dense_weights, teacher.parameters()))
    assert all(p.requires_grad for p in student.parameters())  # flags given back


def test_fit_layers_names_missing_layers():
    teacher, student = _compressed_lookup(0.3)
    with pytest.raises(ValueError, match="inplace=True"):
        fit_layers(student, teacher, [torch.zeros(2, 3, dtype=torch.long)], layers=["nope"],
                   progress=False)


def test_fit_layers_covers_any_dense_layer_type():
    """A Hugging Face Conv1D (weight stored transposed) is fitted like a Linear."""
    from transformers.pytorch_utils import Conv1D

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = Conv1D(128, 128)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x)

    torch.manual_seed(0)
    teacher = Block()
    mix = torch.randn(128, 128) / 128**0.5  # correlated inputs: the fit must weigh them
    batches = [torch.randn(32, 128) @ mix for _ in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        student = cc.optimize(copy.deepcopy(teacher), cc.CompressionConfig(budget=0.3,
                                                                           include=["proj"]),
                              init="dense", example_inputs=(batches[0],), inplace=True,
                              compile=False)
    assert compressed_layers(student, teacher) == ["proj"]
    before, after = fit_layers(student, teacher, batches, steps=40, progress=False)["proj"]
    assert after < 0.9 * before


class _Block(torch.nn.Module):
    """Two wide Linear layers on inputs whose energy sits in a few directions."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(64, 128)
        self.down = torch.nn.Linear(128, 64)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


def _skewed(rows: int, seed: int) -> torch.Tensor:
    basis = torch.linalg.qr(torch.randn(64, 64, generator=torch.Generator().manual_seed(0)))[0]
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 64, generator=gen) * torch.logspace(0, -2, 64)) @ basis


@pytest.mark.parametrize("fmt", ["tt", "ttm", "lowrank"])
def test_fit_layers_improves_every_format(fmt):
    torch.manual_seed(0)
    teacher = _Block().eval()
    data = [_skewed(64, seed) for seed in range(1, 9)]
    held = _skewed(512, 99)  # other rows of the same distribution
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        student = cc.optimize(copy.deepcopy(teacher), 0.3, init="dense", format=fmt,
                              inplace=True, compile=False)
    assert compressed_layers(student, teacher) == ["up", "down"]

    def error():
        with torch.no_grad():
            return float(distill_loss(student(held), teacher(held)))

    before = error()
    result = fit_layers(student, teacher, data, steps=30, progress=False)
    assert all(after < 0.9 * first for first, after in result.values()), result
    assert error() < 0.9 * before
    again = fit_layers(student, teacher, data, steps=5, lr=1.0, progress=False)
    assert all(after <= first for first, after in again.values())  # never worse


def test_fit_layers_solves_a_low_rank_table_in_closed_form_and_gives_its_time_away(adam_steps):
    """A low-rank table's fit loss is minimised by the SVD weighted by the recorded lookup
    frequencies: the fit sets it at once and spends no Adam time on it."""
    from comera_compile.formats.whiten import weighted_lowrank_table
    from comera_compile.nn import TTEmbedding

    class Lookup(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Embedding(1000, 48)

        def forward(self, ids):
            return self.table(ids)

    torch.manual_seed(0)
    teacher = Lookup().eval()
    gen = torch.Generator().manual_seed(3)
    probs = 1.0 / torch.arange(1, 1001, dtype=torch.float64)
    batches = [torch.multinomial(probs, 256, replacement=True, generator=gen).reshape(8, 32)
               for _ in range(6)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        student = cc.optimize(copy.deepcopy(teacher), 0.3, init="dense", inplace=True,
                              example_inputs=batches[0], compile=False)
    table = student.table
    assert isinstance(table, TTEmbedding) and list(table.row_modes) == [1000, 1]
    result = fit_layers(student, teacher, batches, time_limit=30, progress=False)
    assert adam_steps == []  # the closed form is the optimum: no Adam step, no time spent
    first, after = result["table"]
    assert after < first  # the whole fit set's frequencies beat the first batch's
    counts = torch.bincount(torch.cat([b.reshape(-1) for b in batches]), minlength=1000)
    freq = 0.9 * counts.double() / counts.sum() + 0.1 / 1000
    left, right = weighted_lowrank_table(teacher.table.weight.detach(), freq,
                                         table.ranks[1], damping=1e-6)
    torch.testing.assert_close(table.to_dense(), left @ right, rtol=1e-4, atol=1e-5)


def test_fit_layers_draws_ids_evenly_at_uniform_one_and_refuses_other_shares():
    teacher, student = _compressed_lookup(0.5)
    batches = [torch.randint(1000, (4, 16)) for _ in range(2)]
    result = fit_layers(student, teacher, batches, steps=3, uniform=1.0, progress=False)
    assert result["table"][1] <= result["table"][0]
    with pytest.raises(ValueError, match=r"uniform is a share .* in \[0, 1\]"):
        fit_layers(student, teacher, batches, steps=1, uniform=1.5, progress=False)


def test_fit_layers_sets_a_low_rank_linear_to_its_whitened_svd_and_gives_its_time_away(
        adam_steps):
    """A plain low-rank layer's fit loss is minimised by the SVD of its weight whitened by
    the recorded input Gram (Eckart-Young in the output norm): the fit sets it and spends
    no Adam time on it."""
    from comera_compile.nn import LowRankLinear

    torch.manual_seed(0)
    teacher = _Block().eval()
    data = [_skewed(64, seed) for seed in range(1, 9)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        student = cc.optimize(copy.deepcopy(teacher), 0.3, init="dense", format="lowrank",
                              inplace=True, compile=False)
    layer = student.up
    assert type(layer) is LowRankLinear
    before, after = fit_layers(student, teacher, data, time_limit=30, progress=False)["up"]
    assert not any(id(p) in step for step in adam_steps for p in layer.parameters())
    x = torch.cat(data).double()
    weight = teacher.up.weight.detach().double()
    factor = torch.linalg.cholesky(x.T @ x / len(x))
    spectrum = torch.linalg.svdvals(factor.T @ weight.T)
    best = float((spectrum[layer.rank:] ** 2).sum() / (spectrum**2).sum())
    with torch.no_grad():
        error = x @ (layer.to_dense().double() - weight).T
    got = float(error.square().sum() / (x @ weight.T).square().sum())
    assert after <= before and got < 1.05 * best, (got, best)



def test_fit_layers_records_a_tied_table_looked_up_through_another_module():
    """T5's ``shared`` table is looked up through ``encoder.embed_tokens``, another module
    holding the same weight: its ids arrive there, and a layer the teacher never calls is
    left alone with a warning instead of failing the fit."""

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.shared = nn.Embedding(300, 32)
            self.encoder = nn.Module()
            self.encoder.embed_tokens = nn.Embedding(300, 32)
            self.encoder.embed_tokens.weight = self.shared.weight
            self.unused = nn.Linear(64, 64)
            self.proj = nn.Linear(32, 64)

        def forward(self, ids):
            return self.proj(self.encoder.embed_tokens(ids))

    torch.manual_seed(0)
    teacher = Tied().eval()
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 300, (8, 16), generator=gen) for _ in range(4)]
    student = copy.deepcopy(teacher)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        student = cc.optimize(student, cc.CompressionConfig(budget=0.4,
                                                            include=["shared", "unused", "proj"]),
                              init="dense", inplace=True, compile=False, example_inputs=batches[0])
    assert "shared" in compressed_layers(student, teacher)
    with pytest.warns(UserWarning, match="never called.*unused"):
        result = fit_layers(student, teacher, batches, layers=["shared", "unused"], steps=20,
                            progress=False)
    assert "unused" not in result
    before, after = result["shared"]
    assert after < before


def test_fit_layers_records_only_the_real_tokens_of_a_padded_batch():
    """A Hugging Face batch pads short texts; padded positions are not data, and in short
    sentences they can be most rows. The recorded Gram and ids skip them."""
    from comera_compile.passes.inputs import real_rows, token_mask
    from comera_compile.training.distill import _capture, _Inputs

    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Embedding(50, 8)
            self.proj = nn.Linear(8, 8)

        def forward(self, input_ids, attention_mask):
            return self.proj(self.table(input_ids))

    model = Tagger().eval()
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
    ids = torch.tensor([[5, 6, 7, 0, 0], [8, 9, 0, 0, 0]])
    batch = {"input_ids": ids, "attention_mask": mask}
    seen = {"table": _Inputs(), "proj": _Inputs()}
    _capture(model, [batch], seen, dict(model.named_modules()), None)
    assert seen["proj"].rows == 5 and sorted(torch.cat(seen["table"].ids).tolist()) == [5, 6, 7,
                                                                                         8, 9]
    x = model.table(ids)[mask.bool()].double()
    torch.testing.assert_close(seen["proj"].gram, x.T @ x)
    assert token_mask([ids]) is None and real_rows(x, mask.bool()) is x  # no layout match


class _Blocks(nn.Module):
    """A stack of identical blocks in an nn.ModuleList, as a transformer's layers."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(32, 128), nn.GELU(),
                                                  nn.Linear(128, 32)) for _ in range(3))

    def forward(self, input_ids, attention_mask):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_distill_matches_the_blocks_and_skips_padding():
    from comera_compile.training.distill import repeated_blocks
    torch.manual_seed(0)
    teacher = _Blocks().eval()
    student = copy.deepcopy(teacher)
    assert repeated_blocks(student, teacher) == ["layers.0", "layers.1", "layers.2"]
    assert repeated_blocks(nn.Linear(2, 2), teacher) == []  # the student lacks them
    with torch.no_grad():
        for layer in student.layers:
            layer[0].weight.mul_(0.7)
    ids = torch.randint(1, 50, (4, 6))
    mask = torch.ones(4, 6, dtype=torch.long)
    mask[:2, 3:] = 0
    batch = {"input_ids": ids, "attention_mask": mask}
    seen = []
    hook = student.layers[0].register_forward_hook(lambda m, i, o: seen.append(o.shape))
    loss = distill(student, teacher, [batch], steps=1, lr=0.0, progress=False)[0]
    hook.remove()
    real = mask.bool()
    with torch.no_grad():  # the loss over real tokens, of the output and each block's own
        got, want, expected = student.embed(ids), teacher.embed(ids), 0.0
        for mine, theirs in zip(student.layers, teacher.layers):
            mine_out, their_out = mine(got), theirs(want)
            expected += float(distill_loss(mine_out[real], their_out[real]))
            got, want = got + mine_out, want + their_out
        expected += float(distill_loss(got[real], want[real]))
    assert loss == pytest.approx(expected, rel=1e-5)
    only_output = distill(student, teacher, [batch], steps=1, lr=0.0, layers=(),
                          progress=False)[0]
    assert only_output == pytest.approx(float(distill_loss(got[real], want[real])), rel=1e-5)
    assert seen[0] == (4, 6, 32)


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama", "t5", "vit"])
def test_distill_defaults_on_hugging_face_models(name):
    """Blocks found and matched, padded text batches regrouped, on models we did not write."""
    from hf_models import HF_MODELS

    from comera_compile.training.distill import repeated_blocks
    torch.manual_seed(0)
    build, inputs, _ = HF_MODELS[name]()
    teacher = build().eval()
    batches = []
    for seed in range(3):
        batch = {k: v.roll(seed, 0) for k, v in inputs.items()}
        if "input_ids" in batch and name != "t5":  # right padded, rows of other lengths
            mask = torch.ones_like(batch["input_ids"])
            mask[0, 4 + seed:] = 0
            batch["attention_mask"] = mask
        batches.append(batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        student = cc.optimize(copy.deepcopy(teacher), 0.5, init="dense", inplace=True,
                              compile=False, example_inputs=batches[0])
    blocks = repeated_blocks(student, teacher)
    assert len(blocks) >= 2 and all(b.rsplit(".", 1)[-1].isdigit() for b in blocks)
    start = copy.deepcopy(student)
    with_blocks = distill(student, teacher, batches, steps=4, lr=1e-3, progress=False)
    output_only = distill(start, teacher, batches, steps=1, lr=0.0, layers=(),
                          progress=False)
    assert all(torch.isfinite(torch.tensor(with_blocks)))
    assert with_blocks[0] > output_only[0] > 0  # the blocks' own errors are added
