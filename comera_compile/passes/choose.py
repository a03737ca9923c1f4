"""Choose: the format of each pretrained Linear layer, by its output error at its size."""

from __future__ import annotations

import torch
from torch import Tensor

from comera_compile.formats import LOWRANK, TT, TTM
from comera_compile.passes.candidates import Candidate
from comera_compile.passes.rewrite import build_layer
from comera_compile.passes.specs import LayerSpec, auto_modes, make_spec
from comera_compile.passes.spectra import dense_weight

AUTO = "auto"
ALLOCATED_AS = LOWRANK  # the format the allocator sizes layers in under format="auto"
CHOICES = (LOWRANK, TT, TTM)
_MAX_SEARCH_RANK = 1024


def output_error(cand: Candidate, spec: LayerSpec, gram: Tensor) -> float:
    """Relative output error ``tr(D G D^T) / tr(W G W^T)`` of the layer ``spec`` built with
    the activation-aware init, ``D`` its weight's difference from the dense one."""
    layer = build_layer(cand, spec, "dense", gram=gram)
    with torch.no_grad():
        weight = dense_weight(cand).double()
        diff = layer.to_dense().double() - weight
        g = gram.double()
        num = float(((diff @ g) * diff).sum())  # tr(D G D^T), two plain ops
        den = float(((weight @ g) * weight).sum())
    return num / den if den > 0 else 0.0


def largest_spec(cand: Candidate, fmt: str, params: int) -> LayerSpec | None:
    """``fmt``'s spec at the largest uniform rank with at most ``params`` parameters."""
    ins, outs = auto_modes(cand, fmt)
    if make_spec(cand, fmt, 1, ins, outs).params > params:
        return None
    lo, hi = 1, _MAX_SEARCH_RANK
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if make_spec(cand, fmt, mid, ins, outs).params <= params:
            lo = mid
        else:
            hi = mid - 1
    return make_spec(cand, fmt, lo, ins, outs)


def choose_formats(chosen: dict[str, tuple[Candidate, LayerSpec]], grams: dict[str, Tensor],
                   keep: set[str]) -> dict[str, str]:
    """Swap each chosen low-rank or TT Linear layer (not in ``keep``) to the format of least
    output error at no more parameters; in place. Returns why each layer has its format."""
    reasons = {}
    for name, (cand, spec) in list(chosen.items()):
        gram = grams.get(name)
        if cand.is_embedding or gram is None or name in keep or spec.format not in (TT, LOWRANK):
            continue
        options = {spec.format: spec}
        for fmt in CHOICES:
            if fmt == spec.format:
                continue
            other = largest_spec(cand, fmt, spec.params)
            if other is not None:
                options[fmt] = other
        errors = {fmt: output_error(cand, s, gram) for fmt, s in options.items()}
        best = min(errors, key=errors.get)
        chosen[name] = (cand, options[best])
        scores = ", ".join(f"{fmt} {err:.3f} ({options[fmt].params:,} params)"
                           for fmt, err in errors.items())
        reasons[name] = f"format {best}: least output error at its size ({scores})"
    return reasons
