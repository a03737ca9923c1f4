"""What every tensorized layer shares: a chain of cores, rank gates, pruning and layouts."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from comera_compile.nn.gates import DEFAULT_THRESHOLD, alive, fold_gates
from comera_compile.nn.planned import PlannedLayer


class LayoutMismatchError(ValueError):
    """A state dict was saved from a layer whose modes (not just ranks) differ."""


def gate_dtype(dtype: torch.dtype) -> torch.dtype:
    """Gates stay float32 in a bf16 / fp16 model: near 1.0 a bf16 gate cannot take a 1e-3
    optimizer step (it rounds away) and its threshold test would be coarse."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def output_dtype(x: Tensor) -> torch.dtype:
    """The dtype ``nn.Linear`` returns for input ``x``: the autocast dtype inside an enabled
    ``torch.autocast`` region, else the input's own."""
    device = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


LAYOUT_KEY = "_extra_state"
"""Where a layer's layout sits under its prefix in a state dict: its ``nn.Module`` extra
state, read by ``comera_compile.io`` and by the sharded checkpoints of ``training``."""


def encode_layout(layout: dict[str, Any]) -> Tensor:
    """A layout as a uint8 tensor of its JSON text: extra state that safetensors (and so
    ``save_pretrained``) can store, and that runs no code when read back."""
    data = json.dumps(layout, sort_keys=True).encode()
    return torch.tensor(list(data), dtype=torch.uint8)


def decode_layout(value: Any) -> dict[str, Any]:
    """The layout ``encode_layout`` wrote (a plain dict passes through)."""
    if isinstance(value, dict):
        return value
    return json.loads(bytes(value.detach().cpu().to(torch.uint8).tolist()).decode())


_METADATA = (  # what a NoDenseWeight answers: its description, never its values
    torch.Tensor.dtype.__get__, torch.Tensor.shape.__get__, torch.Tensor.device.__get__,
    torch.Tensor.ndim.__get__, torch.Tensor.layout.__get__, torch.Tensor.is_meta.__get__,
    torch.Tensor.is_cuda.__get__, torch.Tensor.requires_grad.__get__, torch.Tensor.size,
    torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.element_size,
    torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.__repr__,
    torch.Tensor.__len__,
)


class NoDenseWeight(Tensor):
    """What a tensorized layer's ``.weight`` returns: the dense weight's dtype and shape, and
    an error for anything that would compute with its values, which do not exist."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", str(func))
        raise RuntimeError(
            f"{name}() was called on the .weight of a tensorized layer, which has no dense "
            "weight (it computes through its cores). Call the layer itself (self.lin(x), not "
            "F.linear(x, self.lin.weight)); or keep the layer dense "
            "(CompressionConfig(exclude=[name])); or build the weight on purpose with "
            "layer.to_dense()"
        )


@dataclass
class PruneResult:
    """What ``prune_ranks`` removed; ``slices`` lists ``(parameter, dim, kept_indices)`` in
    order, so an optimizer's per-parameter state can be sliced the same way."""

    removed: list[int]
    params_before: int
    params_after: int
    slices: list[tuple[nn.Parameter, int, Tensor]] = field(default_factory=list, repr=False)

    @property
    def total_removed(self) -> int:
        return sum(self.removed)

    def __bool__(self) -> bool:
        return self.total_removed > 0


def _forget_grad_accumulator(param: nn.Parameter) -> None:
    """Make autograd drop the gradient accumulator it caches for the leaf ``param``."""
    other = torch.float32 if param.dtype == torch.float64 else torch.float64
    param.data = param.data.new_empty(0, dtype=other)


def _slice_parameter(param: nn.Parameter, dim: int, index: Tensor) -> None:
    """Shrink a parameter in place, keeping its identity (optimizers hold the object)."""
    kept = param.data.index_select(dim, index).contiguous()
    _forget_grad_accumulator(param)
    param.data = kept
    if param.grad is not None:  # a sparse gradient (a sparse table's cores) is sliced dense
        grad = param.grad.to_dense() if param.grad.is_sparse else param.grad
        param.grad = grad.index_select(dim, index).contiguous()


def _renew_parameter_dicts(*holders: nn.Module) -> None:
    """Give each holder a fresh parameter dict (same order, same objects). Shrinking
    ``.data`` changes no dict, and some torch.compile versions skip a module's tensor guards
    while its dicts are unchanged: a compiled graph would then run on the old shapes."""
    for holder in holders:
        holder._parameters = dict(holder._parameters)


def _round_up_kept(keep: Tensor, gate: Tensor, multiple_of: int) -> Tensor:
    """``keep`` plus the largest-magnitude dropped channels, up to a multiple of
    ``multiple_of`` (or every channel)."""
    kept = int(keep.sum())
    target = min(gate.numel(), -(-kept // multiple_of) * multiple_of)
    if target == kept:
        return keep
    magnitude = gate.detach().abs().masked_fill(keep, float("inf"))
    keep = keep.clone()
    keep[magnitude.topk(target).indices] = True
    return keep


class TensorizedLayer(PlannedLayer, nn.Module):
    """Base class: cores + rank gates + pruning + a state dict that carries the layout."""

    format: str = ""
    left_bond_dim = 0
    """The dim of a core that holds its left bond: 0 in a chain ``(r_{k-1}, ..., r_k)``.
    ``TTEmbedding`` keeps its cores slices first, ``(m_k, r_{k-1}, n_k, r_k)`` (dim 1)."""

    def __init__(self, cores: list[Tensor], threshold: float = DEFAULT_THRESHOLD) -> None:
        super().__init__()
        if not 0 <= threshold < 1:
            raise ValueError(f"threshold must be in [0, 1), got {threshold}")
        self.threshold = float(threshold)
        self.cores = nn.ParameterList(nn.Parameter(c) for c in cores)
        self.gates = nn.ParameterList(
            nn.Parameter(torch.ones(c.shape[-1], dtype=gate_dtype(c.dtype), device=c.device))
            for c in cores[:-1]
        )
        self.objective = "combo"
        self._plans: dict[Any, Any] = {}

    def _apply(self, fn, recurse=True):
        """``.to(torch.bfloat16)`` / ``.half()`` cast the cores; gates go back to float32."""
        super()._apply(fn, recurse)
        for gate in self.gates:
            wanted = gate_dtype(gate.dtype)
            if gate.is_floating_point() and gate.dtype != wanted:
                gate.data = gate.data.to(wanted)
                if gate.grad is not None:
                    gate.grad = gate.grad.to(wanted)
        return self

    # ----- shape of the chain -------------------------------------------------------------
    @property
    def ranks(self) -> list[int]:
        """Stored ranks ``[1, r_1, ..., r_{L-1}, 1]`` (shrink only through ``prune_ranks``)."""
        cores = list(self.cores)  # a ParameterList's slice builds a new module
        return [1] + [int(c.shape[-1]) for c in cores[:-1]] + [1]

    def effective_ranks(self) -> list[int]:
        """Ranks counting only gate entries above the threshold, ``[1, ..., 1]`` included."""
        return [1] + [int(alive(g, self.threshold).sum()) for g in self.gates] + [1]

    def core_shape(self, k: int, ranks: list[int]) -> tuple[int, ...]:
        """Shape of core ``k`` for the given rank list (the left bond at ``left_bond_dim``,
        the right bond last, the physical axes between)."""
        shape = [*self.core_physical_shapes()[k], ranks[k + 1]]
        shape.insert(self.left_bond_dim, ranks[k])
        return tuple(shape)

    def core_physical_shapes(self) -> list[tuple[int, ...]]:
        bond = self.left_bond_dim
        return [tuple(int(s) for d, s in enumerate(c.shape[:-1]) if d != bond)
                for c in self.cores]

    def num_core_parameters(self, ranks: list[int] | None = None) -> int:
        ranks = self.ranks if ranks is None else ranks
        return sum(math.prod(self.core_shape(k, ranks)) for k in range(len(self.cores)))

    @property
    def dense_parameters(self) -> int:
        """Parameters of the dense weight this layer replaces (bias excluded)."""
        raise NotImplementedError

    @property
    def weight(self) -> Tensor:
        """A stand-in with the dense weight's shape and the cores' dtype: code that only
        inspects ``layer.weight.dtype`` or ``.shape`` (Hugging Face T5 casts its input to
        ``wo.weight.dtype``) keeps working, while any computation with it raises (a plain
        meta tensor is not enough: ``F.linear(x, meta)`` on CPU returns uninitialised
        memory). The dense weight is never built here; ``to_dense()`` builds it on purpose."""
        if hasattr(self, "in_features"):
            shape = (self.out_features, self.in_features)
        else:
            shape = (self.num_embeddings, self.embedding_dim)
        stand_in = torch.empty(shape, dtype=self.cores[0].dtype, device="meta")
        return stand_in.as_subclass(NoDenseWeight)

    def compression_ratio(self) -> float:
        """Dense weight size over the core size at the effective ranks (gates excluded)."""
        return self.dense_parameters / self.num_core_parameters(self.effective_ranks())

    def gated_cores(self) -> list[Tensor]:
        """Cores with the (thresholded) gates folded into their right bonds."""
        return fold_gates(list(self.cores), list(self.gates), self.threshold)

    def chain_cores(self) -> list[Tensor]:
        """``gated_cores()`` in chain order, ``(r_{k-1}, ..., r_k)``, as the format functions
        read them (views, whatever ``left_bond_dim`` is)."""
        return [c.movedim(self.left_bond_dim, 0) for c in self.gated_cores()]

    # ----- pruning ------------------------------------------------------------------------
    @torch.no_grad()
    def prune_ranks(self, multiple_of: int | None = None) -> PruneResult:
        """Remove dead rank channels from cores and gates for real; outputs do not change."""
        if multiple_of is None:
            multiple_of = 8 if self.cores[0].is_cuda else 1
        if isinstance(multiple_of, bool) or not isinstance(multiple_of, int) or multiple_of < 1:
            raise ValueError(f"multiple_of must be a positive int, got {multiple_of!r}")
        before = self.num_core_parameters()
        removed, slices = [], []
        for k, gate in enumerate(self.gates):
            keep = alive(gate, self.threshold)
            if not bool(keep.any()):  # keep one channel so the chain stays a valid matrix
                keep[gate.detach().abs().argmax()] = True
            keep = _round_up_kept(keep, gate, multiple_of)
            if bool(keep.all()):
                removed.append(0)
                continue
            index = keep.nonzero().flatten()
            removed.append(int(gate.numel() - index.numel()))
            left, right = self.cores[k], self.cores[k + 1]
            for param, dim in ((left, left.dim() - 1), (right, self.left_bond_dim), (gate, 0)):
                _slice_parameter(param, dim, index)
                slices.append((param, dim, index))
        if any(removed):
            self.invalidate_plans()
            _renew_parameter_dicts(self.cores, self.gates)
        return PruneResult(removed, before, self.num_core_parameters(), slices)

    @torch.no_grad()
    def _set_cores(self, cores: list[Tensor]) -> None:
        """Adopt new cores (from an SVD, say): ranks follow their shapes, gates reset to ones."""
        if len(cores) != len(self.cores):
            raise ValueError(f"expected {len(self.cores)} cores, got {len(cores)}")
        for param, core in zip(self.cores, cores):
            param.data = core.detach().to(param.dtype).contiguous()
        for k, gate in enumerate(self.gates):
            gate.data = gate.data.new_ones(cores[k].shape[-1])
        self.invalidate_plans()

    def invalidate_plans(self) -> None:
        """Forget cached contraction plans (ranks changed, so the best order may too)."""
        self._plans.clear()

    # ----- state dict carries the layout --------------------------------------------------
    def layout(self) -> dict[str, Any]:
        """What defines the layer's shape; saved with the weights."""
        return {"format": self.format, "ranks": self.ranks, "threshold": self.threshold}

    def get_extra_state(self) -> Tensor:
        return encode_layout(self.layout())

    def set_extra_state(self, state: Any) -> None:
        self.threshold = float(decode_layout(state).get("threshold", self.threshold))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, errors):
        saved = state_dict.get(prefix + LAYOUT_KEY)
        if saved is not None:
            self._adopt_layout(decode_layout(saved))
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
        )

    def _adopt_layout(self, saved: dict[str, Any]) -> None:
        """Resize cores and gates to a saved rank layout; refuse a different shape family."""
        mine = self.layout()
        fixed = {k: v for k, v in mine.items() if k not in ("ranks", "threshold")}
        theirs = {k: saved.get(k) for k in fixed}
        if fixed != theirs:
            raise LayoutMismatchError(
                f"checkpoint layout {saved} does not fit this layer's layout {mine}; "
                "build the layer with the same modes (or load with comera_compile.load, "
                "which rebuilds layers from the checkpoint)"
            )
        ranks = list(saved["ranks"])
        if ranks == self.ranks:
            return
        if len(ranks) != len(self.ranks):
            raise LayoutMismatchError(f"checkpoint ranks {ranks} vs layer ranks {self.ranks}")
        for k, core in enumerate(self.cores):
            core.data = core.data.new_empty(self.core_shape(k, ranks))
        for k, gate in enumerate(self.gates):
            gate.data = gate.data.new_empty(ranks[k + 1])
        self.invalidate_plans()

    def extra_repr(self) -> str:
        return f"ranks={self.ranks}, effective={self.effective_ranks()}"


def tensorized_layers(model: nn.Module) -> dict[str, TensorizedLayer]:
    """Every tensorized layer of ``model`` by qualified name (a compiled model is unwrapped)."""
    model = getattr(model, "_orig_mod", model)
    return {name: m for name, m in model.named_modules() if isinstance(m, TensorizedLayer)}
