"""Planned contractions as ``torch.library`` ops: what a layer calls while torch.compile traces."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .cache import get_plan
from .embedding import embedding_plan
from .host import capturing
from .networks import tt_linear_network, ttm_linear_network
from .regions import guard_to_region, region_of

_NETWORKS = {"tt": tt_linear_network, "lowrank": tt_linear_network, "ttm": ttm_linear_network}

_lib = torch.library.Library("comera", "DEF")
_lib.define("tt_contract(Tensor x, Tensor[] cores, str kind, int[] in_modes, int[] out_modes, "
            "str objective, bool autotune) -> Tensor")
_lib.define("tt_lookup(Tensor ids, Tensor[] cores, int[] row_modes, int[] col_modes) -> Tensor")

CONTRACT = torch.ops.comera.tt_contract.default
LOOKUP = torch.ops.comera.tt_lookup.default
TENSORIZED_OPS = (CONTRACT, LOOKUP)

_plans: dict[tuple, Any] = {}


def traced_plans() -> dict[tuple, Any]:
    """Plans the ops looked up while compiling, keyed by ``(kind, modes, ranks, bucket,
    dtype, device type, objective)``; a view for tests and reports."""
    return dict(_plans)


def row_bucket(rows: int | torch.SymInt) -> int:
    """The smallest power of two >= ``rows`` (1 for ``rows <= 1``)."""
    bucket = 1
    while rows > bucket:
        bucket *= 2
    return bucket


def _bond_ranks(cores: Sequence[Tensor]) -> list[int]:
    """``[1, r_1, .., 1]`` from the cores' right bonds (a pruned layer plans at its new ranks).
    A symbolic bond (``compile.policy.rank_dims``) is read through its hint, without a guard: the
    graph's program is planned at today's ranks and runs at any others."""
    return [1, *(symbolic_hint(c.shape[-1]) for c in cores[:-1]), 1]


@contextlib.contextmanager
def _real_tensors():
    """Leave fake-tensor and proxy tracing for a moment: autotuning times real kernels."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with unset_fake_temporarily(), disable_proxy_modes_tracing():
        yield


def symbolic_hint(value: int | torch.SymInt) -> int:
    """The concrete value behind a symbolic size, read without adding a guard (raises for
    an unbacked size, which has none)."""
    try:
        from torch.fx.experimental.symbolic_shapes import optimization_hint
    except ImportError:  # older torch: the symbol's own hint
        if not isinstance(value, torch.SymInt):
            return int(value)
        if value.node.hint is None:
            raise ValueError("an unbacked size has no hint") from None
        return int(value.node.hint)
    return optimization_hint(value)


def _hint(rows: int | torch.SymInt) -> int | None:
    """The concrete value behind a symbolic row count, or None where it has none."""
    try:
        return symbolic_hint(rows)
    except Exception:  # an unbacked count has no value to read
        return None


def _region_bucket(rows: int | torch.SymInt, plan_at) -> int:
    """The bucket whose plan runs ``rows``. A symbolic count is guarded to the whole region
    that bucket's plan serves (``planner.regions``), not to the bucket."""
    hint = _hint(rows) if isinstance(rows, torch.SymInt) else None
    if hint is None:
        return row_bucket(rows)
    bucket = row_bucket(hint)
    guard_to_region(rows, *region_of(plan_at, bucket))
    return bucket


def _tt_contract(x, cores, kind, in_modes, out_modes, objective, autotune):
    ranks = _bond_ranks(cores)
    autotune = bool(autotune) and not capturing()  # timing would sync inside a capture
    new_network = _NETWORKS[kind]

    def plan_at(bucket: int):
        return get_plan(new_network(tuple(in_modes), tuple(out_modes), ranks, bucket),
                        dtype=x.dtype, device_type=x.device.type, objective=objective)

    if autotune:  # timed on real tensors, for the bucket alone
        bucket = row_bucket(x.shape[0])
        network = new_network(tuple(in_modes), tuple(out_modes), ranks, bucket)
        with _real_tensors():
            plan = get_plan(network, dtype=x.dtype, device_type=x.device.type,
                            objective=objective, autotune=True)
    else:
        bucket = _region_bucket(x.shape[0], plan_at)
        plan = plan_at(bucket)
    key = (kind, tuple(in_modes), tuple(out_modes), tuple(ranks), bucket)
    _plans[(*key, x.dtype, x.device.type, objective)] = plan
    return plan.execute(x, *cores)


def _tt_lookup(ids, cores, row_modes, col_modes):
    ranks = _bond_ranks(cores)

    def plan_at(bucket: int):
        return embedding_plan(tuple(row_modes), tuple(col_modes), ranks, bucket)

    bucket = _region_bucket(ids.shape[0], plan_at)
    plan = plan_at(bucket)
    key = ("tt_embedding", tuple(row_modes), tuple(col_modes), tuple(ranks), bucket)
    _plans[(*key, cores[0].dtype, ids.device.type, plan.objective)] = plan
    return plan.lookup(ids, cores)


_lib.impl("tt_contract", _tt_contract, "CompositeImplicitAutograd")
_lib.impl("tt_lookup", _tt_lookup, "CompositeImplicitAutograd")


def planned_contract(x: Tensor, cores: Sequence[Tensor], kind: str, in_modes: Sequence[int],
                     out_modes: Sequence[int], objective: str = "combo",
                     autotune: bool = False) -> Tensor:
    """``x (rows, *in_modes)`` contracted with a TT (``kind="tt"``) or TTM (``"ttm"``) chain
    through the plan of the rows' bucket, as one traceable op."""
    return CONTRACT(
        x, list(cores), kind, list(in_modes), list(out_modes), objective, bool(autotune)
    )


def planned_lookup(ids: Tensor, cores: Sequence[Tensor], row_modes: Sequence[int],
                   col_modes: Sequence[int]) -> Tensor:
    """Rows of a TTM embedding table for 1-d ``ids``, as one traceable op."""
    return LOOKUP(ids, list(cores), list(row_modes), list(col_modes))
