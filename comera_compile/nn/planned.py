"""How a layer picks and reports its plan: one cache per layer, keyed by row bucket."""

from __future__ import annotations

import torch
from torch import Tensor

from comera_compile.planner import ForwardPlan, PlanRecord, next_power_of_two, record_plan


class PlannedLayer:
    """Mixin for modules with a ``_plans`` dict (cleared whenever their ranks change)."""

    _plans: dict

    def _new_plan(self, bucket: int, dtype: torch.dtype, device_type: str) -> ForwardPlan:
        """Plan the forward for ``bucket`` rows (a power of two)."""
        raise NotImplementedError

    def dense_macs(self, rows: int) -> int:
        """Multiply-adds of the dense layer this one replaces, for ``rows`` rows (or ids)."""
        raise NotImplementedError

    def _plan_reference(self) -> Tensor:
        """A tensor whose dtype and device the plans default to (the first core)."""
        return self.cores[0]

    def plan_for(self, rows: int, dtype: torch.dtype | None = None,
                 device_type: str | None = None) -> ForwardPlan:
        """The cached plan for this many rows (bucketed to a power of two); dtype and device
        default to the cores'."""
        if dtype is None or device_type is None:
            reference = self._plan_reference()
            dtype = dtype or reference.dtype
            device_type = device_type or reference.device.type
        key = (next_power_of_two(rows), dtype, device_type)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._new_plan(*key)
        return plan

    def plan_record(self, name: str, batch_size: int, dtype: torch.dtype | None = None,
                    device_type: str | None = None) -> PlanRecord:
        """Which plan runs for ``batch_size`` rows, and what it costs against dense."""
        plan = self.plan_for(batch_size, dtype, device_type)
        return record_plan(name, plan, self.dense_macs(batch_size), batch_size)
