"""Inductor's dtype rules built once per compile, not once per generated op."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def _registries_key() -> tuple[int, int]:
    from torch._inductor.codegen.common import pointwise_overrides_data
    from torch._inductor.utils import op_dtype_propagation_rules

    return len(op_dtype_propagation_rules), len(pointwise_overrides_data)


@contextlib.contextmanager
def dtype_rules_once(enabled: bool = True) -> Iterator[None]:
    """Within: the dtype handler's rule table is built once (module docstring);
    ``enabled=False`` changes nothing."""
    from torch._inductor.dtype_propagation import DtypePropagationOpsHandler as Handler

    if not enabled or "_comera_built" in vars(Handler):
        yield  # off, or already patched by an enclosing compile
        return
    init = Handler.__init__

    def init_once(self: Any) -> None:
        key = _registries_key()
        if self.__dict__.get("_comera_rules_key") != key:
            init(self)
            self.__dict__["_comera_rules_key"] = key

    Handler.__init__ = init_once
    Handler._comera_built = True
    try:
        yield
    finally:
        Handler.__init__ = init
        del Handler._comera_built
