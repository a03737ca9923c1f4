"""The part TTLinear and TTMLinear share: padding, bias, and a forward through the planner."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from comera_compile.nn.base import output_dtype
from comera_compile.nn.planned import PlannedLayer
from comera_compile.planner import Plan, get_plan
from comera_compile.planner.ops import planned_contract


class PlannedLinearMixin(PlannedLayer):
    """Mixed into a ``TensorizedLayer`` that defines ``in_modes``, ``out_modes``,
    ``network_cores()`` and ``_network(rows)``."""

    in_features: int
    out_features: int
    in_modes: tuple[int, ...]
    out_modes: tuple[int, ...]
    autotune: bool = False

    @property
    def dense_parameters(self) -> int:
        return self.in_features * self.out_features

    def layout(self) -> dict:
        return {
            **super().layout(),
            "in_features": self.in_features,
            "out_features": self.out_features,
            "in_modes": list(self.in_modes),
            "out_modes": list(self.out_modes),
            "bias": self.bias is not None,
        }

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

    def _finish(self, y: Tensor, lead: torch.Size, bias_added: bool = False) -> Tensor:
        y = y.reshape(y.shape[0], self.padded_out)
        if self.padded_out != self.out_features:
            y = y[:, : self.out_features]
        if self.bias is not None and not bias_added:
            y = y + self.bias.to(y.dtype)  # a float32 bias must not promote a bf16 output
        return y.reshape(*lead, self.out_features)

    def _new_plan(self, bucket: int, dtype: torch.dtype, device_type: str) -> Plan:
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        return get_plan(
            self._network(bucket),
            dtype=dtype,
            device_type=device_type,
            objective=self.objective,
            autotune=self.autotune and not capturing,  # timing would sync the host
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
            y = planned_contract(
                x2.reshape(rows, *self.in_modes),
                self.network_cores(),
                self.format,
                self.in_modes,
                self.out_modes,
                self.objective,
                self.autotune,
            )
            return self._finish(y, lead).to(dtype)
        plan = self.plan_for(rows, x.dtype, x.device.type)
        # the bias rides in the last matmul when the output needs no un-padding
        bias = self.bias if self.padded_out == self.out_features else None
        if bias is not None:
            bias = bias.view(self.out_modes)
        y = plan.execute(x2.reshape(rows, *self.in_modes), *self.network_cores(), bias=bias)
        return self._finish(y, lead, bias_added=bias is not None).to(dtype)
