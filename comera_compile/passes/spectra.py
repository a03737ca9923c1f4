"""Spectra: how much a layer's weight loses at each TT rank, from singular values computed once."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from comera_compile.formats import LOWRANK, is_lowrank_table
from comera_compile.formats.whiten import row_weights, whiten_tt_matrix
from comera_compile.passes.candidates import CONV1D, Candidate
from comera_compile.passes.inputs import as_call, quiet_eval, real_rows, token_mask
from comera_compile.passes.specs import TT, LayerSpec


def dense_weight(cand: Candidate) -> Tensor:
    """The weight as ``(out, in)`` for Linear-like layers, ``(rows, dim)`` for embeddings."""
    weight = cand.weight.detach()
    return weight.T if cand.kind == CONV1D else weight


def chain_tensor(cand: Candidate, spec: LayerSpec, gram: Tensor | None = None) -> Tensor:
    """The weight zero-padded and arranged as the chain the layer's TT-SVD factorizes;
    with the input ``gram`` of a Linear, the whitened weight whose truncation error is the
    output's (``formats.whiten``; TT chains only: TTM's Kronecker-factored whitening is too
    coarse to rank its layers against the others, so they keep the weight's spectrum); with
    a table's row frequencies, its rows weighted by them (low-rank tables only)."""
    weight = dense_weight(cand).float()
    ins, outs = list(spec.in_modes), list(spec.out_modes)
    tt_chain = spec.format in (TT, LOWRANK)
    if tt_chain:  # TTLinear factorizes W^T (in, out) over in_modes + out_modes
        matrix, rows, cols = weight.T, ins, outs
    elif cand.is_embedding:  # (rows, dim) over row_modes x col_modes
        matrix, rows, cols = weight, ins, outs
    else:  # TTM linear: (out, in) over out_modes x in_modes, one pair per core
        matrix, rows, cols = weight, outs, ins
    padded = F.pad(matrix, (0, math.prod(cols) - matrix.shape[1],
                            0, math.prod(rows) - matrix.shape[0]))
    if gram is not None and tt_chain:
        padded = whiten_tt_matrix(padded, gram)
    elif gram is not None and cand.is_embedding and is_lowrank_table(rows, cols):
        padded = padded * row_weights(gram).to(padded.dtype)[:, None]
    if tt_chain:
        return padded.reshape(*rows, *cols)
    d = len(rows)
    perm = [i for k in range(d) for i in (k, d + k)]
    return padded.reshape(*rows, *cols).permute(perm).reshape(
        [m * n for m, n in zip(rows, cols)])


@dataclass
class Spectrum:
    """Per bond, the squared singular mass dropped at each rank; plus the squared norm."""

    tails: list[list[float]]  # tails[k][r]: sum of s_i^2 for i >= r on bond k's unfolding
    norm_sq: float

    def relative_sq_error(self, ranks: Sequence[int]) -> float:
        """Bound on ||W - TT(W)||^2 / ||W||^2 at full rank list ``ranks`` (boundary 1s too)."""
        if self.norm_sq == 0:
            return 0.0
        dropped = sum(tail[min(r, len(tail) - 1)] for tail, r in zip(self.tails, ranks[1:-1]))
        return dropped / self.norm_sq


def layer_spectrum(cand: Candidate, spec: LayerSpec, gram: Tensor | None = None) -> Spectrum:
    """Singular values of every unfolding of the layer's chain tensor (one Gram each);
    whitened by the input ``gram`` when given, so its errors are relative output errors."""
    tensor = chain_tensor(cand, spec, gram).double()
    dims = list(tensor.shape)
    tails = []
    with torch.no_grad():
        for k in range(1, len(dims)):
            unfolding = tensor.reshape(math.prod(dims[:k]), -1)
            if unfolding.shape[0] > unfolding.shape[1]:
                unfolding = unfolding.T
            # squared singular values = eigenvalues of the smaller Gram matrix (fast, float64)
            sq = torch.linalg.eigvalsh(unfolding @ unfolding.T).clamp_min(0).flip(0)
            tails.append([*sq.flip(0).cumsum(0).flip(0).tolist(), 0.0])
    return Spectrum(tails, float(tensor.double().square().sum()))


def output_weights(model: nn.Module, example_inputs: Any,
                   cands: Sequence[Candidate]) -> dict[str, float]:
    """Per layer: relative output error per unit of relative weight error, at these inputs."""
    stats: dict[str, list] = {}
    names = {id(c.module): c.name for c in cands}

    def hook(module, inputs):
        name = names.get(id(module))
        if name is None or not inputs or not isinstance(inputs[0], Tensor):
            return
        x = inputs[0].detach()
        entry = stats.setdefault(name, [0.0, 0.0, 0])  # energy in, energy out, rows
        weight = dense_weight(next(c for c in cands if c.name == name)).float()
        if x.is_floating_point():
            x2 = x.reshape(-1, x.shape[-1]).float()
            entry[0] += float(x2.square().sum())
            entry[1] += float((x2 @ weight.T).square().sum())
            entry[2] += x2.shape[0]
        else:  # embedding ids
            ids = x.reshape(-1)
            entry[1] += float(weight[ids].square().sum())
            entry[2] += ids.numel()

    handles = [c.module.register_forward_pre_hook(hook) for c in cands]
    args, kwargs = as_call(example_inputs)
    try:
        with quiet_eval(model):
            model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    weights = {}
    for cand in cands:
        if cand.name not in stats:
            continue
        energy_in, energy_out, rows = stats[cand.name]
        norm_sq = float(dense_weight(cand).float().square().sum())
        if cand.is_embedding:
            typical = norm_sq / cand.in_features * rows
        else:
            typical = norm_sq * energy_in / cand.in_features
        if energy_out > 0 and typical > 0:
            weights[cand.name] = typical / energy_out
    return weights


def input_grams(model: nn.Module, example_inputs: Any,
                cands: Sequence[Candidate]) -> dict[str, Tensor]:
    """Per layer the forward calls, its input Gram at ``example_inputs`` (float64, CPU), for
    the activation-aware truncation: ``X^T X / rows`` for a Linear-like layer; for an
    embedding table (one-hot inputs, a diagonal Gram) its diagonal, the share of lookups
    that hit each row."""
    grams: dict[str, list] = {}
    names = {id(c.module): c for c in cands}
    for cand in cands:  # a tied table looked up through other modules (T5's shared one)
        for alias in cand.aliases:
            try:
                names.setdefault(id(model.get_submodule(alias)), cand)
            except AttributeError:
                pass

    def hook(module, inputs):
        cand = names.get(id(module))
        if cand is None or not inputs or not isinstance(inputs[0], Tensor):
            return
        x = real_rows(inputs[0].detach(), mask)
        entry = grams.setdefault(cand.name, [0.0, 0])
        if cand.is_embedding:
            if x.is_floating_point() or x.numel() == 0:
                return
            ids = x.reshape(-1).cpu().long()
            entry[0] = entry[0] + torch.bincount(ids, minlength=cand.in_features).double()
            entry[1] += ids.numel()
            return
        if not x.is_floating_point():
            return
        x2 = x.reshape(-1, x.shape[-1]).double().cpu()
        entry[0] = entry[0] + x2.T @ x2
        entry[1] += x2.shape[0]

    mask = token_mask(example_inputs)  # padded tokens are not what the layers serve
    handles = [module.register_forward_pre_hook(hook) for module in model.modules()
               if id(module) in names]
    args, kwargs = as_call(example_inputs)
    try:
        with quiet_eval(model), torch.no_grad():
            model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return {name: gram / max(rows, 1) for name, (gram, rows) in grams.items()
            if isinstance(gram, Tensor)}


def relative_error(cand: Candidate, layer: nn.Module) -> float:
    """Measured ||W - W_tt||_F / ||W||_F of a built layer against the layer it replaces."""
    with torch.no_grad():
        original = dense_weight(cand).float()
        rebuilt = layer.to_dense().float()
        if cand.is_embedding and cand.module.padding_idx is not None:
            original = original.clone()
            original[cand.module.padding_idx] = 0
        norm = float(original.norm())
        return float((rebuilt - original).norm()) / norm if norm > 0 else 0.0
