"""A graph's CPU kernels built in one compiler run per worker: the same results as
inductor's one run per kernel, fewer libraries built, and inductor's path when pooling fails."""

import os
from pathlib import Path

import pytest
import torch
from torch._inductor.utils import fresh_cache

from comera_compile.compile.cpu import pooled_kernels as pk


def _several_kernels(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Matmuls between elementwise work: inductor emits a kernel for each stretch."""
    h = torch.relu(x * 2 + 1) @ w
    h = torch.softmax(h, -1) @ w.T
    h = torch.tanh(h).cumsum(-1) @ w
    return h.square().mean(0)


def _built_libraries() -> int:
    return sum(1 for _ in Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]).rglob("*.main.so"))


def _compiled_result(pooled: bool):
    torch._dynamo.reset()
    x, w = torch.randn(32, 24), torch.randn(24, 24)
    with fresh_cache():
        if pooled:
            with pk.pooled_kernels():
                out = torch.compile(_several_kernels, backend="inductor")(x, w)
        else:
            out = torch.compile(_several_kernels, backend="inductor")(x, w)
        return out, _several_kernels(x, w), _built_libraries()


def test_pooled_kernels_match_inductors_own_and_build_fewer_libraries():
    out, ref, alone = _compiled_result(pooled=False)
    pooled_out, pooled_ref, pooled = _compiled_result(pooled=True)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
    assert torch.allclose(pooled_out, pooled_ref, rtol=1e-5, atol=1e-6)
    assert alone >= 3  # inductor: a library per kernel
    workers = torch._inductor.async_compile.get_compile_threads()
    assert pooled == min(workers, alone)  # pooled: one per compile worker


def test_pooled_kernels_train_as_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                torch.nn.LayerNorm(32), torch.nn.Linear(32, 8))
    x = torch.randn(8, 16)
    proj = torch.randn(8)
    with fresh_cache(), pk.pooled_kernels():
        out = torch.compile(model)(x)
        (out @ proj).square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref = model(x)
    (ref @ proj).square().mean().backward()
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
    for g, p in zip(grads, model.parameters()):
        assert torch.allclose(g, p.grad, rtol=1e-4, atol=1e-6)


def test_a_failed_pool_builds_each_kernel_alone(monkeypatch, caplog):
    monkeypatch.setattr(pk, "pooled_source", lambda kernels: "this is not C++;")
    out, ref, built = _compiled_result(pooled=True)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
    assert built >= 3
    assert "building each kernel alone" in caplog.text


def test_pooled_source_names_one_binding_per_kernel_and_hoists_includes():
    source = '#include <a.h>\nextern "C" void kernel(const float* in_ptr0) {}\n'
    pooled = pk.pooled_source([(["const float*"], source), (["float*", "int64_t"], source)])
    assert pooled.count("#include <a.h>") == 1 and 'extern "C"' not in pooled
    assert "comera_pool_0::kernel(parse_arg<float*>(args, 0))" in pooled
    assert ("comera_pool_1::kernel(parse_arg<float*>(args, 0), parse_arg<int64_t>(args, 1))"
            in pooled)
    assert '{"kernel_1", kernel_1_py, METH_VARARGS, ""}' in pooled and "PyInit_kernel" in pooled


def test_the_patch_ends_with_the_context():
    from torch._inductor.async_compile import AsyncCompile

    bind = AsyncCompile.cpp_pybinding
    with pk.pooled_kernels():
        assert AsyncCompile.cpp_pybinding is not bind
    assert AsyncCompile.cpp_pybinding is bind
    with pytest.raises(ValueError), pk.pooled_kernels():
        raise ValueError
    assert AsyncCompile.cpp_pybinding is bind
