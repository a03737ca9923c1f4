"""torch.fx passes behind ``optimize``: capture -> shapes -> select -> rewrite -> report.

Each pass is a plain function on plain data, so each can be tested (and reused) alone.
The names below are the passes' public surface: ``optimize`` uses nothing else.
"""

from comera_compile.passes.attention import restore_untouched, split_attention
from comera_compile.passes.budget import Budget, parse_budget, parse_bytes
from comera_compile.passes.candidates import Candidate, find_candidates
from comera_compile.passes.capture import Capture, capture, exact_graph_module
from comera_compile.passes.choose import ALLOCATED_AS, AUTO, choose_formats  # noqa: E402
from comera_compile.passes.fuse import fuse_captured
from comera_compile.passes.materialize import materialize, on_meta
from comera_compile.passes.report import (
    OptimizeReport,
    Summary,
    attach_report,
    layer_records,
    report_of,
    summary,
)
from comera_compile.passes.rewrite import build_layer, check_init, rewrite
from comera_compile.passes.row_cache import CachePlan, plan_caches
from comera_compile.passes.select import (
    DEFAULT_MAX_RANK,
    BudgetUnreachable,
    Selection,
    eligible_options,
    select_layers,
    weigh_tables,
)
from comera_compile.passes.sensitivity import output_sensitivities
from comera_compile.passes.shapes import LayerShape, ShapeInfo, propagate_shapes
from comera_compile.passes.specs import LayerSpec, check_format
from comera_compile.passes.spectra import input_grams, output_weights
from comera_compile.passes.targets import check_layer_config, config_for  # noqa: E402

__all__ = [
    "CachePlan",
    "plan_caches",
    "DEFAULT_MAX_RANK",
    "Budget",
    "Candidate",
    "Capture",
    "LayerShape",
    "LayerSpec",
    "OptimizeReport",
    "Selection",
    "ShapeInfo",
    "Summary",
    "attach_report",
    "build_layer",
    "capture",
    "check_format",
    "check_init",
    "eligible_options",
    "weigh_tables",
    "exact_graph_module",
    "find_candidates",
    "fuse_captured",
    "layer_records",
    "materialize",
    "on_meta",
    "input_grams",
    "output_sensitivities",
    "output_weights",
    "parse_budget",
    "parse_bytes",
    "propagate_shapes",
    "report_of",
    "restore_untouched",
    "rewrite",
    "select_layers",
    "BudgetUnreachable",
    "split_attention",
    "summary",
    "ALLOCATED_AS",
    "AUTO",
    "check_layer_config",
    "choose_formats",
    "config_for",
]
