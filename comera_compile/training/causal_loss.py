"""A causal language model's loss whose backward keeps no copy of the logits."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from comera_compile.nn.cola_linear import CoLALinear
from comera_compile.nn.gates import hard_threshold

ROWS = 256
"""Rows of logits the forward exponentiates at once."""

BLOCK_ELEMENTS = 2**25
"""Logits the head's recomputing backward makes at once: each block reads the head's last
factor and writes its gradient once more, so fewer, larger blocks are faster; a block is
made after the forward's logits are freed."""


class _CrossEntropySum(torch.autograd.Function):
    """Summed cross entropy of 2-d ``logits`` against ``target`` (``ignore_index`` rows
    count nothing), keeping the logits and one log-sum-exp per row for backward."""

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, ignore_index: int) -> Tensor:
        lse = _log_sum_exp(logits)
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


def _log_sum_exp(logits: Tensor) -> Tensor:
    lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    for start in range(0, logits.shape[0], ROWS):
        lse[start:start + ROWS] = torch.logsumexp(logits[start:start + ROWS].float(), -1)
    return lse


class _HeadCrossEntropySum(torch.autograd.Function):
    """Summed cross entropy of ``logits = h @ w + bias`` (2-d ``h``; ``logits`` given, as the
    head made them, with no gradient of their own), keeping ``h``, ``w`` and a log-sum-exp per
    row; backward remakes the logits in blocks of rows (module docstring)."""

    @staticmethod
    def forward(ctx, h: Tensor, w: Tensor, bias: Tensor | None, logits: Tensor, target: Tensor,
                ignore_index: int) -> Tensor:
        lse = _log_sum_exp(logits)
        valid = target != ignore_index
        picked = logits.gather(1, torch.where(valid, target, 0)[:, None])[:, 0].float()
        ctx.save_for_backward(h, w, bias, lse, target, valid)
        return ((lse - picked) * valid).sum()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        h, w, bias, lse, target, valid = ctx.saved_tensors
        need_h, need_w, need_bias = ctx.needs_input_grad[:3]
        dh = torch.empty_like(h) if need_h else None
        dw = torch.zeros_like(w) if need_w else None
        dbias = torch.zeros_like(bias) if bias is not None and need_bias else None
        scale = (valid * grad).to(h.dtype)
        picks = torch.where(valid, target, 0)
        # scale * softmax = exp(logits - lse + log(scale)): the shift rides on the product
        # (one pass over the block fewer for each of the subtraction and the scaling)
        folded = bool((scale >= 0).all())
        shift = (scale.log() if folded else torch.zeros_like(scale)) - lse.to(h.dtype)
        rows = max(1, BLOCK_ELEMENTS // w.shape[1])
        for start in range(0, h.shape[0], rows):
            part = slice(start, start + rows)
            hp = h[part]
            if bias is None:
                p = torch.addmm(shift[part, None], hp, w)
            else:
                p = torch.addmm(bias, hp, w).add_(shift[part, None])
            p.exp_()  # the block's softmax, times its rows' scale where folded
            if folded:
                p.scatter_add_(1, picks[part, None], -scale[part, None])
            else:
                p.scatter_add_(1, picks[part, None], torch.full_like(p[:, :1], -1.0))
                p.mul_(scale[part, None])
            if dh is not None:
                torch.matmul(p, w.mT, out=dh[part])
            if dw is not None:
                dw.addmm_(hp.mT, p)
            if dbias is not None:
                dbias.add_(p.sum(0))
        return dh, dw, dbias, None, None, None


def _tag_head_output(module: torch.nn.Module, args: tuple, output: Any) -> None:
    """Forward hook on the output head: mark the logits with the head and its input."""
    if (torch.is_tensor(output) and args and torch.is_tensor(args[0]) and output.requires_grad
            and not torch.compiler.is_compiling()):
        output._comera_head = (module, args[0])


def tag_head_outputs(head: torch.nn.Module) -> bool:
    """Let :func:`causal_lm_loss` recompute ``head``'s logits in backward (module docstring);
    False (nothing done) for a head whose factors it cannot name."""
    if head_factors(head, None) is None:
        return False
    if not any(h is _tag_head_output for h in head._forward_hooks.values()):
        head.register_forward_hook(_tag_head_output)
    return True


def untag_head_outputs(head: torch.nn.Module) -> None:
    """Undo :func:`tag_head_outputs`."""
    for key, hook in list(head._forward_hooks.items()):
        if hook is _tag_head_output:
            del head._forward_hooks[key]


def head_factors(head: torch.nn.Module, x: Tensor | None):
    """``(h, w, bias)`` with ``head(x) = h @ w + bias`` over ``x``'s rows, for an
    ``nn.Linear`` (``h = x``) or a CoLA layer (``h = silu(x U) diag(g)``); None for another
    head. With ``x`` None, only whether the head is one of them (a true value or None)."""
    if type(head) is torch.nn.Linear:
        if x is None:
            return True
        return x.reshape(-1, head.in_features), head.weight.mT, head.bias
    if type(head) is CoLALinear:
        if x is None:
            return True
        u, v = head.cores
        gate = hard_threshold(head.gates[0], head.threshold)
        h = F.silu(x.reshape(-1, head.in_features) @ u.reshape(head.in_features, -1)) * gate
        return h, v.reshape(-1, head.out_features), head.bias
    return None


def _head_of(logits: Tensor):
    """The ``(h, w, bias)`` of the head that made ``logits``, where it was tagged and the
    logits are plain float32 (no autocast)."""
    tag = None if torch.compiler.is_compiling() else getattr(logits, "_comera_head", None)
    if tag is None or logits.dtype != torch.float32 or torch.is_autocast_enabled(
            logits.device.type):
        return None
    head, x = tag
    factors = head_factors(head, x)
    if factors is None or factors[0].dtype != torch.float32:
        return None
    return factors


def causal_lm_loss(logits: Tensor, labels: Tensor, vocab_size: int,
                   num_items_in_batch: Tensor | int | None = None, ignore_index: int = -100,
                   shift_labels: Tensor | None = None, **kwargs: Any) -> Tensor:
    """Hugging Face's ``ForCausalLMLoss`` (same arguments, same value), with the backward of
    the module docstring."""
    if shift_labels is None:  # tokens < n predict n
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    head = _head_of(logits)
    logits = logits.reshape(-1, vocab_size)
    shift_labels = shift_labels.reshape(-1).to(logits.device)
    if head is not None and head[1].shape[-1] == vocab_size:
        h, w, bias = head
        total = _HeadCrossEntropySum.apply(h, w, bias, logits.detach(), shift_labels,
                                           ignore_index)
    else:
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
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, torch.nn.Module):
        tag_head_outputs(head)
    return True


def drop_lean_causal_loss(model: torch.nn.Module) -> None:
    """Undo :func:`use_lean_causal_loss`."""
    if model.__dict__.get("_loss_function") is causal_lm_loss:
        del model._loss_function
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, torch.nn.Module):
        untag_head_outputs(head)
