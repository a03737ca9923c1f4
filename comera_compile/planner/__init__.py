"""Contraction planning: each tensorized layer's forward as a tensor network, its best tree
per batch-size bucket (cotengra), cached in memory and on disk, run as plain torch ops."""

from .cache import cache_dir, clear_memory_cache, get_plan
from .costs import evaluate_path, parse_objective
from .embedding import EmbeddingPlan, embedding_plan
from .host import capturing, host_reads_allowed
from .network import BATCH, Network, next_power_of_two
from .networks import tt_linear_network, ttm_linear_network
from .plan import FORMAT_VERSION, Plan
from .planning import plan_network
from .protocol import ForwardPlan, RowCost
from .records import PlanRecord, PlanReport, record_plan

__all__ = ["BATCH", "EmbeddingPlan", "FORMAT_VERSION", "ForwardPlan", "Network", "Plan",
           "PlanRecord", "PlanReport", "RowCost", "cache_dir", "capturing", "clear_memory_cache",
           "embedding_plan", "evaluate_path", "get_plan", "host_reads_allowed", "next_power_of_two",
           "parse_objective", "plan_network", "record_plan", "tt_linear_network",
           "ttm_linear_network"]
