"""Inductor's dtype rule table built once per compile: the same rules, the patch undone."""

import torch
import torch._inductor.lowering  # noqa: F401  (registers the dtype rules, as a compile does)
from torch._inductor.dtype_propagation import DtypePropagationOpsHandler as Handler
from torch._inductor.utils import op_dtype_propagation_rules

from comera_compile.compile.cpu.dtype_rules import dtype_rules_once


def test_the_rule_table_is_built_once_and_again_when_the_registries_change():
    op = next(iter(op_dtype_propagation_rules))
    original = Handler.__init__
    with dtype_rules_once():
        handler = Handler()
        assert op in vars(handler)
        del handler.__dict__[op]
        assert Handler() is handler and op not in vars(handler)  # not rebuilt
        handler.__dict__["_comera_rules_key"] = None  # as if a rule had been registered
        assert op in vars(Handler())  # rebuilt
        with dtype_rules_once():  # nested: one patch
            assert Handler.__init__ is not original
    assert Handler.__init__ is original and "_comera_built" not in vars(Handler)
    Handler()  # the original table, complete again


def test_a_compile_under_it_matches_eager():
    def f(x, y):
        return torch.nn.functional.silu(x) * y.to(torch.float64) + (x > 0).to(torch.int32)

    x, y = torch.randn(64, 33), torch.randn(64, 33, dtype=torch.float16)
    compiled = torch.compile(f, backend="comera")
    torch.testing.assert_close(compiled(x, y), f(x, y))
