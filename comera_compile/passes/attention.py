"""Attention: split every ``nn.MultiheadAttention`` so its projections can be tensorized."""

from __future__ import annotations

from collections.abc import Collection

from torch import nn

from comera_compile.nn import SplitMultiheadAttention
from comera_compile.passes.rewrite import names_of, set_module


def split_attention(model: nn.Module) -> dict[str, nn.MultiheadAttention]:
    """Swap every ``nn.MultiheadAttention`` in ``model`` for a split one; returns the originals
    by name (one entry per module, under its first name)."""
    originals = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.MultiheadAttention):
            split = SplitMultiheadAttention(module)
            for alias in names_of(model, module):
                set_module(model, alias, split)
            originals[name] = module
    return originals


def restore_untouched(model: nn.Module, originals: dict[str, nn.MultiheadAttention],
                      chosen: Collection[str], skipped: dict[str, str]) -> None:
    """Put back each original attention none of whose projections is ``chosen``; its four
    projection entries in ``skipped`` become one entry for the attention."""
    for name, original in originals.items():
        split = model.get_submodule(name)
        if any(n.startswith(name + ".") for n in chosen):
            continue
        for alias in names_of(model, split):
            set_module(model, alias, original)
        reasons = [skipped.pop(f"{name}.{p}", None) for p in ("q_proj", "k_proj", "v_proj",
                                                                "out_proj")]
        reason = next((r for r in reasons if r), "no projection was chosen")
        skipped[name] = f"nn.MultiheadAttention kept as is ({reason})"
