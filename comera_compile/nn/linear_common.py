"""The part TTLinear and TTMLinear share: padding, bias, and a forward through the planner."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from comera_compile.nn.base import next_power_of_two


class PlannedLinearMixin:
    """Mixed into a ``TensorizedLayer`` that defines ``in_modes``, ``out_modes``,
    ``network_cores()`` and ``_network(rows)``."""

    in_features: int
    out_features: int
    in_modes: tuple[int, ...]
    out_modes: tuple[int, ...]
    autotune: bool = False

    def _init_bias(self, bias: bool, device, dtype) -> None:
        if not bias:
            self.register_parameter("bias", None)
            return
        bound = 1.0 / math.sqrt(self.in_features)  # nn.Linear's default
        self.bias = nn.Parameter(torch.empty(self.out_features, device=device, dtype=dtype))
        nn.init.uniform_(self.bias, -bound, bound)

    @property
    def padded_in(self) -> int:
        return math.prod(self.in_modes)

    @property
    def padded_out(self) -> int:
        return math.prod(self.out_modes)

    def _pad_input(self, x2: Tensor) -> Tensor:
        pad = self.padded_in - self.in_features
        return F.pad(x2, (0, pad)) if pad else x2

    def _finish(self, y: Tensor, lead: torch.Size) -> Tensor:
        y = y.reshape(y.shape[0], self.padded_out)
        if self.padded_out != self.out_features:
            y = y[:, : self.out_features]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def plan_for(self, rows: int, dtype: torch.dtype, device_type: str):
        """The cached contraction plan for this many input rows (bucketed to a power of two)."""
        key = (next_power_of_two(rows), dtype, device_type)
        plan = self._plans.get(key)
        if plan is None:
            from comera_compile.planner import get_plan

            plan = get_plan(
                self._network(key[0]),
                dtype=dtype,
                device_type=device_type,
                objective=self.objective,
                autotune=self.autotune,
            )
            self._plans[key] = plan
        return plan

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"{type(self).__name__} expects inputs of shape (*, {self.in_features}), "
                f"got {tuple(x.shape)}"
            )
        lead = x.shape[:-1]
        x2 = self._pad_input(x.reshape(-1, self.in_features))
        rows = x2.shape[0]
        plan = self.plan_for(rows, x.dtype, x.device.type)
        y = plan.execute(x2.reshape(rows, *self.in_modes), *self.network_cores())
        return self._finish(y, lead)
