"""What the block-structured Linear layers share (BTT, Monarch): bias, padding, layout,
the plan record and a forward of two batched matmuls."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from comera_compile.nn.base import TensorizedLayer, output_dtype
from comera_compile.nn.linear_shape import RandomLinear
from comera_compile.planner import PlanRecord


class BlockLinear(RandomLinear, TensorizedLayer):
    """Base of ``BTTLinear`` and ``MonarchLinear``: subclasses give ``_multiply(x2, dtype)``
    (padded rows in, padded outputs out), ``macs_per_row()`` and ``core_fan_ins()``."""

    # ----- the forward --------------------------------------------------------------------
    def _multiply(self, x2: Tensor, dtype: torch.dtype) -> Tensor:
        raise NotImplementedError

    def macs_per_row(self) -> int:
        raise NotImplementedError

    def hidden_width(self) -> int:
        """Entries per row between the two matmuls."""
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"{type(self).__name__} expects inputs of shape (*, {self.in_features}), "
                f"got {tuple(x.shape)}"
            )
        dtype = output_dtype(x)  # as nn.Linear: the autocast dtype inside autocast
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(dtype)
        pad = math.prod(self.in_modes) - self.in_features
        if pad:
            x2 = F.pad(x2, (0, pad))
        y = self._multiply(x2, dtype)
        if y.shape[1] != self.out_features:
            y = y[:, : self.out_features]
        if self.bias is not None:
            y = y + self.bias.to(dtype)
        return y.reshape(*lead, self.out_features)

    forward_fixed_order = forward

    # ----- plans: one fixed program -------------------------------------------------------
    def dense_macs(self, rows: int) -> int:
        return rows * self.in_features * self.out_features

    def plan_record(self, name: str, batch_size: int, dtype: torch.dtype | None = None,
                    device_type: str | None = None) -> PlanRecord:
        """The one program this layer runs (two batched matmuls) and its cost."""
        rows = int(batch_size)
        macs = rows * self.macs_per_row()
        dense = self.dense_macs(rows)
        peak = rows * max(math.prod(self.in_modes), math.prod(self.out_modes),
                          self.hidden_width())
        return PlanRecord(name, self.format, rows, "bmm(bmm(x, G1), G2)", macs, peak, dense,
                          macs / dense if dense else float("nan"), "", {}, [],
                          self.objective, float(macs), "fixed", rows)

    def _new_plan(self, bucket: int, dtype: torch.dtype, device_type: str):
        raise NotImplementedError(f"{type(self).__name__} runs a fixed program of batched "
                                  "matmuls; it has no planned contraction")

    def to_dense(self) -> Tensor:
        """The ``(out_features, in_features)`` weight (for export and tests, never a forward)."""
        full = self._dense_padded()
        return full[: self.in_features, : self.out_features].T

    def _dense_padded(self) -> Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def frobenius_norm(self) -> float:
        """Norm of the layer's weight (``to_dense`` once: for init scaling, not a forward)."""
        return float(self._dense_padded().float().norm())
