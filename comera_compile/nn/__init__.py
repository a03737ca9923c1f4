"""Tensorized layers: cores + rank gates, forward through a planned contraction."""

from comera_compile.nn.attention import SplitMultiheadAttention
from comera_compile.nn.base import (
    LayoutMismatchError,
    PruneResult,
    TensorizedLayer,
    tensorized_layers,
)
from comera_compile.nn.btt_linear import BTTLinear
from comera_compile.nn.cola_linear import CoLALinear
from comera_compile.nn.gates import DEFAULT_THRESHOLD
from comera_compile.nn.lowrank_linear import LowRankLinear
from comera_compile.nn.monarch_linear import MonarchLinear
from comera_compile.nn.tied_head import TiedEmbeddingHead
from comera_compile.nn.tt_embedding import TTEmbedding
from comera_compile.nn.tt_linear import TTLinear
from comera_compile.nn.ttm_linear import TTMLinear

LEAF_MODULES = (TensorizedLayer, SplitMultiheadAttention, TiedEmbeddingHead)
"""Modules a graph capture keeps whole: their forward picks a plan per batch size."""

__all__ = ["BTTLinear", "CoLALinear", "LEAF_MODULES", "DEFAULT_THRESHOLD", "LayoutMismatchError",
           "LowRankLinear", "MonarchLinear", "PruneResult", "SplitMultiheadAttention",
           "TTEmbedding", "TiedEmbeddingHead", "TTLinear", "TTMLinear", "TensorizedLayer",
           "tensorized_layers"]
