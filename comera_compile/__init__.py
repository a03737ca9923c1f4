"""comera_compile: train PyTorch models directly in tensor-train compressed form (CoMERA)."""

from comera_compile import training
from comera_compile.api import (
    Budget,
    CompileOptions,
    CompressionConfig,
    Summary,
    config_of,
    load,
    optimize,
    plans,
    save,
    summary,
    to_graph_module,
)
from comera_compile.nn import (
    BTTLinear,
    LowRankLinear,
    MonarchLinear,
    TTEmbedding,
    TTLinear,
    TTMLinear,
)

__version__ = "0.1.0"

__all__ = ["BTTLinear", "Budget", "CompileOptions", "CompressionConfig", "LowRankLinear",
           "MonarchLinear", "Summary", "TTEmbedding", "TTLinear", "TTMLinear", "config_of", "load",
           "optimize", "plans", "save", "summary", "to_graph_module", "training", "__version__"]
