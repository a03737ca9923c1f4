"""The tensorized contractions as ``torch.library`` ops, so torch.compile sees them whole.

While dynamo traces a layer's forward, planning (a cotengra search the first time a shape
is seen) must not be traced: it is Python the tracer cannot follow and would split the
graph. The layers hand their contraction to one of these ops instead (through the hooks
in ``nn.linear_common`` and ``nn.tt_embedding``). Each op is ``CompositeImplicitAutograd``:
its body looks the plan up for the row count it is given (each batch size its own plan)
and runs the plan's pairwise program. Dynamo records one opaque node per layer (the backend
finds and tunes them there); AOT autograd then decomposes the body into plain aten ops
(permute, reshape, bmm), which inductor fuses and differentiates like any other code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from comera_compile.nn import linear_common, tt_embedding
from comera_compile.planner import (
    embedding_plan,
    get_plan,
    next_power_of_two,
    tt_linear_network,
    ttm_linear_network,
)

_NETWORKS = {"tt": tt_linear_network, "lowrank": tt_linear_network, "ttm": ttm_linear_network}

_lib = torch.library.Library("comera", "DEF")
_lib.define(
    "tt_contract(Tensor x, Tensor[] cores, str kind, int[] in_modes, int[] out_modes, "
    "str objective, bool autotune) -> Tensor"
)
_lib.define("tt_lookup(Tensor ids, Tensor[] cores, int[] row_modes, int[] col_modes) -> Tensor")

CONTRACT = torch.ops.comera.tt_contract.default
LOOKUP = torch.ops.comera.tt_lookup.default
TENSORIZED_OPS = (CONTRACT, LOOKUP)

_plans: dict[tuple, Any] = {}


def traced_plans() -> dict[tuple, Any]:
    """Plans the ops specialised while compiling, keyed by ``(kind, modes, ranks, bucket,
    dtype, device type, objective)``; a view for tests and reports."""
    return dict(_plans)


def _bond_ranks(cores: Sequence[Tensor]) -> list[int]:
    """``[1, r_1, .., 1]`` from the cores' right bonds (a pruned layer plans at its new ranks)."""
    return [1, *(int(c.shape[-1]) for c in cores[:-1]), 1]


def _tt_contract(x, cores, kind, in_modes, out_modes, objective, autotune):
    rows = int(x.shape[0])  # a symbolic batch specialises here: every size gets its own plan
    ranks = _bond_ranks(cores)
    network = _NETWORKS[kind](tuple(in_modes), tuple(out_modes), ranks, rows)
    plan = get_plan(
        network, dtype=x.dtype, device_type=x.device.type, objective=objective, autotune=autotune
    )
    key = (
        kind,
        tuple(in_modes),
        tuple(out_modes),
        tuple(ranks),
        next_power_of_two(rows),
        x.dtype,
        x.device.type,
        objective,
    )
    _plans[key] = plan
    return plan.execute(x, *cores)


def _tt_lookup(ids, cores, row_modes, col_modes):
    rows = int(ids.shape[0])
    ranks = _bond_ranks(cores)
    plan = embedding_plan(tuple(row_modes), tuple(col_modes), ranks, rows)
    _plans[
        (
            "tt_embedding",
            tuple(row_modes),
            tuple(col_modes),
            tuple(ranks),
            next_power_of_two(rows),
            cores[0].dtype,
            ids.device.type,
            plan.objective,
        )
    ] = plan
    return plan.lookup(ids, cores)


_lib.impl("tt_contract", _tt_contract, "CompositeImplicitAutograd")
_lib.impl("tt_lookup", _tt_lookup, "CompositeImplicitAutograd")


def contract_hook(layer, x: Tensor, cores: list[Tensor]) -> Tensor:
    """What a TT/TTM linear layer's forward calls while being compiled."""
    return CONTRACT(
        x,
        cores,
        layer.format,
        list(layer.in_modes),
        list(layer.out_modes),
        layer.objective,
        bool(layer.autotune),
    )


def lookup_hook(layer, ids: Tensor, cores: list[Tensor]) -> Tensor:
    """What a TT embedding's lookup calls while being compiled."""
    return LOOKUP(ids, cores, list(layer.row_modes), list(layer.col_modes))


linear_common.traced_contraction = contract_hook
tt_embedding.traced_lookup = lookup_hook
