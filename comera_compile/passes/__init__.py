"""torch.fx passes behind ``optimize``: capture -> shapes -> select -> rewrite -> report.

Each pass is a plain function on plain data, so each can be tested (and reused) alone.
"""

from comera_compile.passes.budget import Budget, parse_budget, parse_bytes
from comera_compile.passes.candidates import Candidate, find_candidates
from comera_compile.passes.capture import Capture, capture
from comera_compile.passes.report import OptimizeReport, Summary, summary
from comera_compile.passes.rewrite import build_layer, rewrite
from comera_compile.passes.select import (
    DEFAULT_MAX_RANK,
    Selection,
    eligible_options,
    select_layers,
)
from comera_compile.passes.shapes import LayerShape, ShapeInfo, propagate_shapes
from comera_compile.passes.specs import LayerSpec

__all__ = [
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
    "build_layer",
    "capture",
    "eligible_options",
    "find_candidates",
    "parse_budget",
    "parse_bytes",
    "propagate_shapes",
    "rewrite",
    "select_layers",
    "summary",
]
