"""torch.fx passes behind ``optimize``: capture -> shapes -> select -> rewrite -> report."""

from comera_compile.passes.budget import Budget, parse_budget
from comera_compile.passes.candidates import Candidate, find_candidates
from comera_compile.passes.capture import Capture, capture, exact_graph_module
from comera_compile.passes.pipeline import tensorize
from comera_compile.passes.report import OptimizeReport, Summary, report_of, summary
from comera_compile.passes.rewrite import check_init
from comera_compile.passes.select import BudgetUnreachable
from comera_compile.passes.shapes import propagate_shapes
from comera_compile.passes.specs import LayerSpec, check_format

__all__ = ["Budget", "BudgetUnreachable", "Candidate", "Capture", "LayerSpec", "OptimizeReport",
           "Summary", "capture", "check_format", "check_init", "exact_graph_module",
           "find_candidates", "parse_budget", "propagate_shapes", "report_of", "summary",
           "tensorize"]
