"""A causal language model's loss whose backward keeps no copy of the logits.

Hugging Face's ``ForCausalLMLoss`` ends in ``F.cross_entropy``, a ``log_softmax`` that keeps
its output for backward (one more tensor the size of the logits) and an ``nll_loss`` whose
backward writes a second one (zeros with the targets scattered in) before ``log_softmax``'s
backward writes the gradient, a third. With a large vocabulary the logits are the largest
tensors of the step (LLaMA-60M at batch 16 x 256: 16 x 256 x 32000 floats, 524 MB each), so
the loss alone holds four of them at its backward's peak. :func:`causal_lm_loss` computes the
same value from the logits and a per-row log-sum-exp, and its backward writes the gradient,
``softmax - onehot``, straight into one new tensor: the logits (which the model returns to its
caller, and so hold anyway) and their gradient. The forward reads the logits in blocks of
rows, so its exponentials never take a full-size buffer either.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

ROWS = 1024
"""Rows of logits the forward exponentiates at once."""


class _CrossEntropySum(torch.autograd.Function):
    """Summed cross entropy of 2-d ``logits`` against ``target`` (``ignore_index`` rows
    count nothing), keeping the logits and one log-sum-exp per row for backward."""

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, ignore_index: int) -> Tensor:
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        for start in range(0, logits.shape[0], ROWS):
            lse[start:start + ROWS] = torch.logsumexp(logits[start:start + ROWS].float(), -1)
        valid = target != ignore_index
        picked = logits.gather(1, torch.where(valid, target, 0)[:, None])[:, 0].float()
        ctx.save_for_backward(logits, lse, target, valid)
        return ((lse - picked) * valid).sum()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        logits, lse, target, valid = ctx.saved_tensors
        out = torch.sub(logits, lse[:, None].to(logits.dtype)).exp_()  # softmax, one buffer
        out.scatter_add_(1, torch.where(valid, target, 0)[:, None],
                         torch.full_like(out[:, :1], -1.0))
        out.mul_((valid * grad).to(out.dtype)[:, None])
        return out, None, None


def causal_lm_loss(logits: Tensor, labels: Tensor, vocab_size: int,
                   num_items_in_batch: Tensor | int | None = None, ignore_index: int = -100,
                   shift_labels: Tensor | None = None, **kwargs: Any) -> Tensor:
    """Hugging Face's ``ForCausalLMLoss`` (same arguments, same value), with the backward of
    the module docstring."""
    if shift_labels is None:  # tokens < n predict n
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    logits = logits.reshape(-1, vocab_size)
    shift_labels = shift_labels.reshape(-1).to(logits.device)
    total = _CrossEntropySum.apply(logits, shift_labels, ignore_index)
    if num_items_in_batch is None:
        return total / (shift_labels != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def uses_hf_causal_loss(model: torch.nn.Module) -> bool:
    """Whether ``model`` computes its loss with Hugging Face's ``ForCausalLMLoss``."""
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        return False
    return getattr(model, "loss_function", None) is ForCausalLMLoss


def use_lean_causal_loss(model: torch.nn.Module) -> bool:
    """Give a Hugging Face causal LM :func:`causal_lm_loss` in place of ``ForCausalLMLoss``
    (``model.loss_function``); returns whether it did (other models are left as they are)."""
    if not uses_hf_causal_loss(model):
        return False
    model.loss_function = causal_lm_loss
    return True


def drop_lean_causal_loss(model: torch.nn.Module) -> None:
    """Undo :func:`use_lean_causal_loss`."""
    if model.__dict__.get("_loss_function") is causal_lm_loss:
        del model._loss_function
