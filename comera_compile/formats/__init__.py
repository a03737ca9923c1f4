"""Pure tensor math for TT formats: modes, ranks, TT/TTM-SVD, reconstruction, counts."""

from ._checks import positive_int, positive_ints, ttm_mode_pairs
from .btt import (
    btt_core_shapes,
    btt_fan_ins,
    btt_init_stds,
    btt_macs_per_row,
    btt_modes,
    btt_multiply,
    btt_params,
    btt_project,
    btt_rank_cap,
    btt_rank_for,
    btt_to_dense,
)
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
    BTT,
    COLA,
    LOWRANK,
    MONARCH,
    ONE_MODE,
    TT,
    TT_CHAINS,
    TT_EMBEDDING,
    TTM,
    chain_layout,
    is_lowrank_table,
    lowrank_table_modes,
)
from .monarch import (
    DEFAULT_BLOCKS,
    monarch_blocks_for,
    monarch_core_shapes,
    monarch_fan_ins,
    monarch_init_stds,
    monarch_modes,
    monarch_multiply,
    monarch_params,
    monarch_project,
    monarch_to_dense,
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

__all__ = ["BTT", "DEFAULT_BLOCKS", "MONARCH", "btt_core_shapes", "btt_fan_ins", "btt_init_stds",
           "btt_macs_per_row", "btt_modes", "btt_multiply", "btt_params", "btt_project",
           "btt_rank_cap", "btt_rank_for", "btt_to_dense", "monarch_blocks_for",
           "monarch_core_shapes", "monarch_fan_ins", "monarch_init_stds", "monarch_modes",
           "monarch_multiply", "monarch_params", "monarch_project", "monarch_to_dense",
           "chain_norm", "LOWRANK", "COLA", "ONE_MODE", "TT", "TTM", "TT_CHAINS", "TT_EMBEDDING",
           "Factorization", "chain_layout", "chain_ranks", "is_lowrank_table",
           "lowrank_table_modes", "choose_order", "clip_ranks", "core_params", "dense_linear_macs",
           "factorize", "lookup_fan_ins", "lr_multipliers", "tt_linear_fan_ins", "ttm_fan_ins",
           "fit_ranks", "internal_ranks", "merge_cores", "positive_int", "positive_ints",
           "rank_caps", "tt_linear_macs", "tt_linear_modes", "tt_linear_params", "tt_random_cores",
           "tt_svd", "tt_svd_with_error", "tt_to_dense", "ttm_linear_macs", "ttm_mode_pairs",
           "ttm_modes", "ttm_params", "ttm_random_cores", "ttm_svd", "ttm_svd_with_error",
           "ttm_to_dense", "zero_pad"]
