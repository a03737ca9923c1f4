"""Pure tensor math for TT formats: modes, ranks, TT/TTM-SVD, reconstruction, counts.

Also the door checks every layer shares (positive ints, rank lists), kept at the bottom of
the package so that formats, planner and layers all read arguments the same way."""

from ._checks import positive_int, positive_ints, ttm_mode_pairs
from .counts import (
    core_params,
    dense_linear_macs,
    tt_linear_macs,
    tt_linear_params,
    ttm_linear_macs,
    ttm_params,
)
from .factorize import (
    Factorization,
    choose_order,
    factorize,
    tt_linear_modes,
    ttm_modes,
    zero_pad,
)
from .layout import (
    COLA,
    LOWRANK,
    ONE_MODE,
    TT,
    TT_CHAINS,
    TT_EMBEDDING,
    TTM,
    chain_layout,
    is_lowrank_table,
    lowrank_table_modes,
)
from .ranks import chain_ranks, clip_ranks, fit_ranks, internal_ranks, rank_caps
from .scaling import (
    lookup_fan_ins,
    lr_multipliers,
    tt_linear_fan_ins,
    ttm_fan_ins,
)
from .tt import chain_norm, merge_cores, tt_random_cores, tt_svd, tt_svd_with_error, tt_to_dense
from .ttm import ttm_random_cores, ttm_svd, ttm_svd_with_error, ttm_to_dense

__all__ = [
    "chain_norm",
    "LOWRANK",
    "COLA",
    "ONE_MODE",
    "TT",
    "TTM",
    "TT_CHAINS",
    "TT_EMBEDDING",
    "Factorization",
    "chain_layout",
    "chain_ranks",
    "is_lowrank_table",
    "lowrank_table_modes",
    "choose_order",
    "clip_ranks",
    "core_params",
    "dense_linear_macs",
    "factorize",
    "lookup_fan_ins",
    "lr_multipliers",
    "tt_linear_fan_ins",
    "ttm_fan_ins",
    "fit_ranks",
    "internal_ranks",
    "merge_cores",
    "positive_int",
    "positive_ints",
    "rank_caps",
    "tt_linear_macs",
    "tt_linear_modes",
    "tt_linear_params",
    "tt_random_cores",
    "tt_svd",
    "tt_svd_with_error",
    "tt_to_dense",
    "ttm_linear_macs",
    "ttm_mode_pairs",
    "ttm_modes",
    "ttm_params",
    "ttm_random_cores",
    "ttm_svd",
    "ttm_svd_with_error",
    "ttm_to_dense",
    "zero_pad",
]
