"""What rank cuts mean for a compiled model: when a cut is worth its recompile, and what
the measured compile ``optimize`` installs is told about the run."""

from __future__ import annotations

from torch import nn

from comera_compile.compile.state import compiled_state
from comera_compile.training.distributed import unwrap

COMPILED_MIN_CUT = 1 / 3
"""A compiled model recompiles at every shape change, so it is cut only once a third of its
core parameters are dead, and where the run needs its final shapes: at most a few
compiles per run (``1 + log(1 / ratio) / log(3 / 2)`` cuts to reach a size ratio)."""


def is_compiled(model: nn.Module) -> bool:
    """Whether ``model``'s training steps run through ``torch.compile`` (wrapped, or
    compiled in place; not where ``optimize``'s measured compile chose eager)."""
    return compiled_state(model).compiled


def cuts_recompile(model: nn.Module) -> bool:
    """Whether a rank cut makes ``model``'s training steps compile again: they run compiled
    (``is_compiled``), at static ranks (``MeasuredCompile.cuts_recompile``)."""
    return compiled_state(model).cuts_recompile


def announce_run(model: nn.Module, steps: int, total_steps: int | None,
                 early_steps: int | None) -> None:
    """Tell a measured compile that the run cuts ranks and, where its length is known, how
    long the training graph will serve: until the first cut where a cut recompiles, else
    until the run's end. It then compiles only if that can pay by then."""
    impl = compiled_state(unwrap(model)).measured
    if impl is None:
        return
    impl.expect_cuts()
    if total_steps is None:
        return
    if not impl.cuts_recompile:
        impl.run_ends_after(total_steps - steps)
    elif early_steps is not None:
        impl.shapes_change_after(early_steps)


def _keep_compiled(model: nn.Module, steps: int, total_steps: int | None) -> bool:
    """Before a cut of a measured compile's model: keep it compiled only if the recompile is
    paid back by the compiled step's gain over the steps left; else run it eager."""
    impl = compiled_state(unwrap(model)).measured
    if impl is None or total_steps is None:
        return True
    why = impl.why_not_recompile(total_steps - steps)
    if not why:
        return True
    impl.run_eager(f"from step {steps}: {why}")
    return False


def worth_cutting(model: nn.Module, dead_share: float, required: bool, steps: int,
                  total_steps: int | None) -> bool:
    """Whether to prune now: always for an eager model (or one at symbolic ranks); for one
    that recompiles per cut, when ``COMPILED_MIN_CUT`` of the cores are dead or the run
    needs its final shapes (``required``)."""
    compiled = cuts_recompile(model)
    if compiled and dead_share > 0 and (dead_share >= COMPILED_MIN_CUT or required):
        compiled = _keep_compiled(model, steps, total_steps)
    min_cut = COMPILED_MIN_CUT if compiled else 0.0
    return dead_share > 0 and (dead_share >= min_cut or required)
