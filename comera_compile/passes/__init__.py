"""torch.fx passes behind ``optimize``: capture -> shapes -> select -> rewrite -> report.

Each pass is a plain function on plain data in a module of its own, so each can be tested
(and reused) alone; :func:`tensorize` (``pipeline``) runs them in order. The names below
are what the rest of the package and users call.
"""

from comera_compile.passes.budget import Budget, parse_budget
from comera_compile.passes.candidates import Candidate, find_candidates
from comera_compile.passes.capture import Capture, capture, exact_graph_module
from comera_compile.passes.pipeline import tensorize
from comera_compile.passes.report import OptimizeReport, Summary, report_of, summary
from comera_compile.passes.rewrite import check_init
from comera_compile.passes.select import BudgetUnreachable
from comera_compile.passes.shapes import propagate_shapes
from comera_compile.passes.specs import LayerSpec, check_format

__all__ = [
    "Budget",
    "BudgetUnreachable",
    "Candidate",
    "Capture",
    "LayerSpec",
    "OptimizeReport",
    "Summary",
    "capture",
    "check_format",
    "check_init",
    "exact_graph_module",
    "find_candidates",
    "parse_budget",
    "propagate_shapes",
    "report_of",
    "summary",
    "tensorize",
]
