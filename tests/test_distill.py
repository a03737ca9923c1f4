"""Distillation: the loss helper, and the loop recovering a compressed model's outputs."""

import copy
import warnings

import pytest
import torch
from models import MLP

import comera_compile.api as cc
from comera_compile.training import distill, distill_loss


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


def test_distill_names_missing_submodules():
    teacher = MLP((64, 256, 64, 32))
    with pytest.raises(ValueError, match="inplace=True"):
        distill(copy.deepcopy(teacher), teacher, [torch.randn(2, 64)], layers=["nope"],
                progress=False)
