"""Inductor's dtype rules built once per compile, not once per generated op.

Inductor's code generation asks :class:`DtypePropagationOpsHandler` for every op it writes
(the CSE proxy's ``_default``) and constructs the handler each time. The class is a
singleton (``__new__`` returns one instance) but Python runs ``__init__`` on every
construction, and that ``__init__`` rebuilds the whole rule table: a ``functools.partial``
per op, ``setattr``, then ``dir(self)`` to check that no op lacks a rule. Its share of a
first compile grows with the ops per kernel: small for plain transformer blocks, largest
where hashed dropout masks (``compile.cpu.dropout``) put a few dozen integer ops into each
kernel that applies one (``python benchmarks/pooled_kernels.py`` times first compiles with
and without it).

:func:`dtype_rules_once` runs the original ``__init__`` only when the rule registries have
changed since it last ran (they are filled at import; a later registration rebuilds the
table), so every construction after the first returns the same, complete instance.
``CompileOptions(dtype_rules_once=False)`` turns it off.
"""

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
