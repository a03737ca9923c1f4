"""The trainer's optional progress bar: written by ``step`` to stderr, closed at the end of a
known-length run, silent by default."""

import torch
from models import train_steps
from torch import nn

from comera_compile.nn import TTLinear
from comera_compile.training import RankAdaptiveTrainer


def run(steps, **kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(
        TTLinear(16, 12, ranks=4, in_modes=[4, 4], out_modes=[3, 4]),
        nn.Tanh(),
        TTLinear(12, 3, ranks=3, in_modes=[3, 4], out_modes=[1, 3]),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = RankAdaptiveTrainer(model, opt, early_steps=3, prune_every=2, **kwargs)
    x = torch.randn(32, 16)
    y = x[:, :3].argmax(1)
    train_steps(model, opt, trainer, x, y, steps)
    return trainer


def test_progress_bar_counts_steps_and_shows_stage_and_size(capsys):
    trainer = run(6, total_steps=6, progress=True)
    err = capsys.readouterr().err
    assert "6/6" in err and "stage=late" in err
    final = trainer.history[-1]["params"] / sum(p.numel() for p in run(0).model.parameters())
    shown = err.rsplit("size=", 1)[1][:5]
    assert shown == f"{final:.3f}" and final < 0.9  # the bar's last size is the run's
    assert trainer._bar is None  # closed after the last step


def test_progress_bar_without_run_length_until_close(capsys):
    trainer = run(4, progress=True)
    assert trainer._bar is not None and trainer._bar.n == 4 and trainer._bar.total is None
    trainer.close()
    assert "4step" in capsys.readouterr().err


def test_no_progress_by_default_writes_nothing(capsys):
    run(4, total_steps=6)
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""
