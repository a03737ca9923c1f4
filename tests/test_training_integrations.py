"""Rank adaptation in the loops people use: Hugging Face ``Trainer`` and Lightning, each
with a real short run that shrinks ranks."""

import pytest
import torch
import torch.nn.functional as F
from models import small_tt_model, toy_classes, train_steps
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from comera_compile.training import LATE, RankAdaptiveTrainer, param_groups

STEPS = 30
OPTIONS = {"early_steps": 10, "prune_every": 5, "target_ratio": 0.5}


pytestmark = pytest.mark.usefixtures("one_thread")


def small_model():
    return small_tt_model()


def data(n=32):
    return toy_classes(n)


def adamw(model):
    return torch.optim.AdamW(param_groups(model, lr_cores=1e-2, lr_gates=1e-2, lr_rest=1e-2))


def plain_loop(model):
    x, y = data()
    opt = adamw(model)
    trainer = RankAdaptiveTrainer(model, opt, total_steps=STEPS, **OPTIONS)
    train_steps(model, opt, trainer, x, y, STEPS)
    return trainer


def assert_shrank(rank_trainer, model):
    assert rank_trainer.stage == LATE and rank_trainer.steps == STEPS
    assert rank_trainer.target_reached
    assert model[0].ranks == model[0].effective_ranks() != [1, 4, 4, 4, 1]
    losses = rank_trainer.history.column("task_loss")
    assert losses[-1] < losses[0]


# ----- Lightning ---------------------------------------------------------------------------
@pytest.mark.slow
def test_lightning_callback_shrinks_ranks_and_matches_the_plain_loop():
    lightning = pytest.importorskip("lightning")
    from comera_compile.integrations.lightning import RankAdaptation

    class Module(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = small_model()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return adamw(self.net)

    module = Module()
    callback = RankAdaptation(**OPTIONS)
    trainer = lightning.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    x, y = data()
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=len(x)))
    assert callback.rank_trainer.total_steps == STEPS
    assert_shrank(callback.rank_trainer, module.net)

    reference = small_model()
    plain_loop(reference)  # gradients added as a loss term instead of in the callback
    for (name, got), want in zip(module.net.state_dict().items(), reference.state_dict().values()):
        if torch.is_tensor(got):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=name)


@pytest.mark.slow
def test_lightning_resume_equals_the_uninterrupted_run(tmp_path):
    lightning = pytest.importorskip("lightning")
    from lightning.pytorch.callbacks import ModelCheckpoint

    from comera_compile.integrations.lightning import RankAdaptation

    class Module(lightning.LightningModule):
        def __init__(self, seed):
            super().__init__()
            self.net = small_tt_model(seed)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return adamw(self.net)

    def run(seed, ckpt_path=None):
        module, callback = Module(seed), RankAdaptation(**OPTIONS)
        saves = ModelCheckpoint(
            dirpath=tmp_path / str(seed), every_n_train_steps=15, save_top_k=-1,
            filename="{step}",
        )
        trainer = lightning.Trainer(
            max_steps=STEPS, accelerator="cpu", logger=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[callback, saves],
        )
        x, y = data()
        loader = DataLoader(TensorDataset(x, y), batch_size=len(x))
        trainer.fit(module, loader, ckpt_path=ckpt_path)
        return module.net, callback.rank_trainer

    whole, whole_trainer = run(0)
    assert whole_trainer.history[14]["ranks"]["net.0"] != [1, 4, 4, 4, 1]  # pruned by then
    resumed, resumed_trainer = run(7, ckpt_path=tmp_path / "0" / "step=15.ckpt")
    assert resumed_trainer.steps == STEPS and resumed[0].ranks == whole[0].ranks
    assert sum(p.numel() for p in resumed.parameters()) == sum(
        p.numel() for p in whole.parameters()
    )
    got, want = resumed_trainer.history, whole_trainer.history
    for column in ("stage", "params", "ranks", "budget"):
        assert got.column(column) == want.column(column), column
    assert got.column("task_loss") == pytest.approx(want.column("task_loss"), rel=1e-9)
    assert list(resumed.state_dict()) == list(whole.state_dict())
    for (name, a), b in zip(resumed.state_dict().items(), whole.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=name)


# ----- Hugging Face ------------------------------------------------------------------------
class Pairs(Dataset):
    def __init__(self):
        self.x, self.y = data()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"features": self.x[i], "labels": self.y[i]}


class Classifier(nn.Module):
    """A model the way ``transformers.Trainer`` expects one: keyword inputs, a loss out."""

    def __init__(self, seed=0):
        super().__init__()
        self.net = small_tt_model(seed)

    def forward(self, features, labels=None):
        logits = self.net(features)
        loss = None if labels is None else F.cross_entropy(logits, labels)
        return {"loss": loss, "logits": logits}


class ItemNormalizedClassifier(Classifier):
    """A model that takes the Trainer's loss kwargs and normalizes over the whole accumulated
    batch itself (as causal LMs do): the Trainer then does not divide its loss."""

    def forward(self, features, labels=None, num_items_in_batch=None, **kwargs):
        logits = self.net(features)
        if labels is None:
            return {"loss": None, "logits": logits}
        loss = F.cross_entropy(logits, labels, reduction="sum") / num_items_in_batch
        return {"loss": loss, "logits": logits}


def hf_args(out, steps=STEPS, batch=32, accumulation=1, **kwargs):
    from transformers import TrainingArguments

    options = {
        "max_steps": steps,
        "per_device_train_batch_size": batch,
        "gradient_accumulation_steps": accumulation,
        "learning_rate": 1e-2,
        "lr_scheduler_type": "constant",
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "seed": 0,
        **kwargs,
    }
    return TrainingArguments(output_dir=str(out), **options)


def test_hugging_face_trainer_adds_rank_terms_and_shrinks_ranks(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import TrainingArguments

    from comera_compile.integrations.huggingface import RankAdaptiveHFTrainer

    model = Classifier()
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=STEPS,
        per_device_train_batch_size=32,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = RankAdaptiveHFTrainer(
        model=model, args=args, train_dataset=Pairs(), rank_adaptation=OPTIONS
    )
    trainer.train()
    rank_trainer = trainer.rank_trainer
    assert rank_trainer.total_steps == STEPS
    assert_shrank(rank_trainer, model.net)
    late = [r for r in rank_trainer.history.records if r["stage"] == LATE]
    assert all(r["rank_loss"] is not None for r in rank_trainer.history.records)
    assert len(late) == STEPS - OPTIONS["early_steps"] + 1

    model.eval()  # evaluation losses carry no rank terms
    with torch.no_grad():
        batch = {k: v.unsqueeze(0) for k, v in Pairs()[0].items()}
        plain = model(**batch)["loss"]
        assert trainer.compute_loss(model, batch) == plain


def gates_of(model):
    return torch.cat([g.detach() for layer in (model.net[0], model.net[2]) for g in layer.gates])


@pytest.mark.parametrize("model_class", [Classifier, ItemNormalizedClassifier])
def test_rank_terms_weigh_the_same_for_any_gradient_accumulation(tmp_path, model_class):
    """1 x 32 and 4 x 8 see the same 32 examples per step: the same gates, step for step."""
    pytest.importorskip("accelerate")
    from comera_compile.integrations.huggingface import RankAdaptiveHFTrainer

    runs = {}
    for batch, accumulation in ((32, 1), (8, 4)):
        model = model_class()
        trainer = RankAdaptiveHFTrainer(
            model=model,
            args=hf_args(tmp_path / str(batch), steps=12, batch=batch, accumulation=accumulation),
            train_dataset=Pairs(),
            rank_adaptation={"early_steps": 6, "prune_every": 3, "target_ratio": 0.5},
        )
        trainer.train()
        runs[accumulation] = (model, trainer.rank_trainer.history)
    (whole, whole_history), (split, split_history) = runs[1], runs[4]
    torch.testing.assert_close(gates_of(split), gates_of(whole), rtol=1e-9, atol=1e-12)
    assert split.net[0].ranks == whole.net[0].ranks != [1, 4, 4, 4, 1]
    for column in ("task_loss", "rank_loss", "params"):
        assert split_history.column(column) == pytest.approx(whole_history.column(column))
    x, y = data()
    first = F.cross_entropy(Classifier().net(x), y).item()  # the whole step's loss, recorded
    assert split_history[0]["task_loss"] == pytest.approx(first, rel=1e-12)


def test_hugging_face_resume_equals_the_uninterrupted_run(tmp_path):
    """Checkpoints every 15 of 30 steps, accumulation 2; resuming at 15 on a fresh model
    (full ranks, other weights) ends where the uninterrupted run does."""
    pytest.importorskip("accelerate")
    from comera_compile.integrations.huggingface import RankAdaptiveHFTrainer

    def run(out, seed, resume=None):
        model = Classifier(seed)
        trainer = RankAdaptiveHFTrainer(
            model=model,
            args=hf_args(
                out, batch=16, accumulation=2, save_strategy="steps", save_steps=15
            ),
            train_dataset=Pairs(),
            rank_adaptation=OPTIONS,
        )
        trainer.train(resume_from_checkpoint=resume)
        return model, trainer.rank_trainer

    whole, whole_trainer = run(tmp_path / "whole", seed=0)
    at_15 = whole_trainer.history[14]
    assert at_15["stage"] == LATE and at_15["ranks"]["net.0"] != [1, 4, 4, 4, 1]  # pruned by then
    checkpoint = str(tmp_path / "whole" / "checkpoint-15")
    resumed, resumed_trainer = run(tmp_path / "resumed", seed=7, resume=checkpoint)

    assert resumed_trainer.steps == STEPS and resumed_trainer.stage == LATE
    assert resumed.net[0].ranks == whole.net[0].ranks and resumed.net[2].ranks == whole.net[2].ranks
    size = sum(p.numel() for p in whole.parameters())
    assert sum(p.numel() for p in resumed.parameters()) == size < 0.7 * 243
    got, want = resumed_trainer.history, whole_trainer.history
    assert len(got) == len(want) == STEPS
    for column in ("stage", "params", "ranks", "budget"):
        assert got.column(column) == want.column(column), column
    assert got.column("task_loss") == pytest.approx(want.column("task_loss"), rel=1e-9)
    for (name, a), b in zip(resumed.state_dict().items(), whole.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=name)


class Sentences(Dataset):
    """Token ids labelled by whether the first token is in the upper half of the vocabulary."""

    def __init__(self, n=64, vocab=1000):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(3, vocab, (n, 12), generator=g)
        self.labels = (self.ids[:, 0] > vocab // 2).long()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


@pytest.mark.slow
def test_bert_classifier_resumed_mid_run_ends_at_the_uninterrupted_size(tmp_path):
    """The run a new user makes: a BERT classifier from a config, optimized, accumulation 2,
    checkpoints every 12 of 24 steps; resumed on a fresh optimized model it is the run."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import comera_compile as cc
    from comera_compile.integrations.huggingface import RankAdaptiveHFTrainer

    def run(out, resume=None):
        torch.manual_seed(0)
        config = transformers.BertConfig(
            vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=256, max_position_embeddings=16, num_labels=2,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )
        model = cc.optimize(transformers.BertForSequenceClassification(config), 0.3,
                            compile=False)
        trainer = RankAdaptiveHFTrainer(
            model=model,
            args=hf_args(out, steps=24, batch=8, accumulation=2, learning_rate=1e-3,
                         lr_scheduler_type="linear", save_strategy="steps", save_steps=12),
            train_dataset=Sentences(),
            rank_adaptation={"target_ratio": 0.5, "early_steps": 8, "prune_every": 4},
        )
        trainer.train(resume_from_checkpoint=resume)
        return model, trainer.rank_trainer

    whole, whole_trainer = run(tmp_path / "whole")
    resumed, resumed_trainer = run(tmp_path / "resumed", str(tmp_path / "whole/checkpoint-12"))
    size = sum(p.numel() for p in whole.parameters())
    assert sum(p.numel() for p in resumed.parameters()) == size
    assert whole_trainer.history[11]["params"] < whole_trainer.history[0]["params"]  # pruned
    target = 0.5 * whole_trainer.size_start  # ends on its target, within the tolerance
    assert abs(whole_trainer.size() / target - 1) <= 0.05 and whole_trainer.target_reached
    got, want = resumed_trainer.history, whole_trainer.history
    for column in ("stage", "params", "ranks"):
        assert got.column(column) == want.column(column), column
    assert got.column("task_loss") == pytest.approx(want.column("task_loss"), rel=1e-5)
