"""The part every planned Linear shares (TTLinear, TTMLinear, LowRankLinear, the tied head):
bias, padding, ``from_dense``, and a forward through the planner."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from comera_compile.nn.base import TensorizedLayer, output_dtype
from comera_compile.nn.linear_shape import LinearShape, RandomLinear
from comera_compile.nn.planned import PlannedLayer
from comera_compile.planner import Plan, capturing, get_plan
from comera_compile.planner.alignment import pad_bonds
from comera_compile.planner.ops import planned_contract


def linear_init_std(in_features: int) -> float:
    """The standard deviation of ``nn.Linear``'s default weight, ``1 / sqrt(3 in_features)``:
    random cores are drawn so that their product has it."""
    return 1.0 / math.sqrt(3 * in_features)


def squeeze_boundary_bonds(cores: list[Tensor]) -> list[Tensor]:
    """A chain's cores with the rank-1 axes at both ends dropped, as the planner's networks
    have them (a single core loses both)."""
    if len(cores) == 1:
        return [cores[0].reshape(cores[0].shape[1:-1])]
    cores[0] = cores[0].reshape(cores[0].shape[1:])
    cores[-1] = cores[-1].reshape(cores[-1].shape[:-1])
    return cores


class PlannedLinearMixin(LinearShape, PlannedLayer):
    """Mixed into a layer that defines ``gated_cores()``, ``_network(rows)`` and (to be
    built from a dense Linear) ``_decompose(weight, ranks, tolerance)``."""

    autotune: bool = False

    @classmethod
    def from_dense(cls, module: nn.Linear, ranks: int | Sequence[int] | None = None,
                   tolerance: float | None = None, gram: Tensor | None = None, **kwargs):
        """The layer's decomposition of a Linear's weight (TT-SVD or TTM-SVD), truncated to
        ``ranks`` and/or the relative error ``tolerance`` (exact when neither is given).
        ``gram``, the inputs' ``X^T X``, truncates the output error instead (``formats.whiten``)."""
        layer = cls(module.in_features, module.out_features, ranks=1, bias=module.bias is not None,
                    device=module.weight.device, dtype=module.weight.dtype, **kwargs)
        weight = module.weight.detach()
        if gram is not None and tolerance is None:
            cores = layer.decompose_whitened(weight, ranks, gram)
        else:
            cores = layer._decompose(weight, ranks, tolerance)
        layer._set_cores(cores)
        if module.bias is not None:
            layer.bias.data.copy_(module.bias.detach())
        return layer

    def _decompose(self, weight: Tensor, ranks, tolerance) -> list[Tensor]:
        """Cores of the ``(out_features, in_features)`` weight, truncated."""
        raise NotImplementedError

    def decompose_whitened(self, weight: Tensor, ranks, gram: Tensor) -> list[Tensor]:
        """Cores of the ``(out_features, in_features)`` weight truncated to ``ranks`` where
        the outputs on inputs of Gram ``gram`` feel it least (``formats.whiten``)."""
        raise NotImplementedError

    def network_cores(self, rows: int | torch.SymInt = 0) -> list[Tensor]:
        """Gated cores shaped as the planner's network has them; for a contraction over
        ``rows`` rows, bonds padded to sizes the device's matmuls run fastest
        (``planner.alignment``; exact: the padding is zeros)."""
        return squeeze_boundary_bonds(pad_bonds(self.gated_cores(), rows))

    @property
    def padded_in(self) -> int:
        return math.prod(self.in_modes)

    @property
    def padded_out(self) -> int:
        return math.prod(self.out_modes)

    def _pad_input(self, x2: Tensor) -> Tensor:
        pad = self.padded_in - self.in_features
        return F.pad(x2, (0, pad)) if pad else x2

    def _finish(self, y: Tensor, lead: torch.Size, bias_added: bool = False) -> Tensor:
        y = y.reshape(y.shape[0], self.padded_out)
        if self.padded_out != self.out_features:
            y = y[:, : self.out_features]
        if self.bias is not None and not bias_added:
            y = y + self.bias.to(y.dtype)  # a float32 bias must not promote a bf16 output
        return y.reshape(*lead, self.out_features)

    def _new_plan(self, bucket: int, dtype: torch.dtype, device_type: str) -> Plan:
        return get_plan(
            self._network(bucket),
            dtype=dtype,
            device_type=device_type,
            objective=self.objective,
            autotune=self.autotune and not capturing(),  # timing would sync the host
        )

    def dense_macs(self, rows: int) -> int:
        return rows * self.in_features * self.out_features

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"{type(self).__name__} expects inputs of shape (*, {self.in_features}), "
                f"got {tuple(x.shape)}"
            )
        lead = x.shape[:-1]
        x2 = self._pad_input(x.reshape(-1, self.in_features))
        rows = x2.shape[0]
        dtype = output_dtype(x)  # as nn.Linear: the autocast dtype for every plan and size
        if torch.compiler.is_compiling():  # one op: planning stays out of the graph
            y = planned_contract(x2.reshape(rows, *self.in_modes), self.network_cores(rows),
                                 self.format, self.in_modes, self.out_modes, self.objective,
                                 self.autotune)
            return self._finish(y, lead).to(dtype)
        plan = self.plan_for(rows, x.dtype, x.device.type)
        # the bias rides in the last matmul when the output needs no un-padding
        bias = self.bias if self.padded_out == self.out_features else None
        if bias is not None:
            bias = bias.view(self.out_modes)
        y = plan.execute(x2.reshape(rows, *self.in_modes), *self.network_cores(rows), bias=bias)
        return self._finish(y, lead, bias_added=bias is not None).to(dtype)


class ChainLinear(PlannedLinearMixin, RandomLinear, TensorizedLayer):
    """A Linear layer whose weight is one chain of cores (TT, TTM): the constructor, the
    cores' fan-ins and the contraction network, which the formats differ in only by the
    functions each subclass names below."""

    format: str
    default_ranks: int
    random_cores: Callable[..., list[Tensor]]  # (layout, std, dtype, device) -> cores
    fan_ins: Callable[..., list[int]]  # (in_modes, ranks) -> each core's fan-in
    network_of: Callable[..., Any]  # (in_modes, out_modes, ranks, rows) -> its network

    def _random_cores(self, chain: Any, in_features: int, device: Any, dtype: Any) -> list[Tensor]:
        return self.random_cores(chain, linear_init_std(in_features), dtype, device)

    def core_fan_ins(self) -> list[int]:
        """Entries of the incoming activation each core sums over (``formats.scaling``)."""
        return type(self).fan_ins(self.in_modes, self.ranks)

    def _network(self, rows: int):
        return type(self).network_of(self.in_modes, self.out_modes, self.ranks, rows)
