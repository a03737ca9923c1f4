"""Build a graph's CPU kernels in one compiler run per worker, not one run per kernel.

Each ``g++`` run first loads the ATen header, so a first compile mostly starts compilers. A
failed pooled build falls back to one kernel at a time; ``pooled_kernels=False`` turns it off.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterator
from typing import Any

from torch._inductor.codecache import CodeCacheFuture

log = logging.getLogger(__name__)

_ENTRY = "kernel"  # the entry point inductor names in every CPU kernel source


class _Pool:
    """The CPU kernels one generated module asked for, built together when first needed."""

    def __init__(self, submit: Callable[..., Any] | None, workers: int) -> None:
        self.submit, self.workers = submit, max(1, workers)
        self.kernels: list[tuple[list[str], str]] = []
        self.functions: dict[int, Callable[..., Any]] = {}

    def add(self, argtypes: list[str], source: str) -> PooledKernel:
        self.kernels.append((list(argtypes), source))
        return PooledKernel(self, len(self.kernels) - 1)

    def function(self, index: int) -> Callable[..., Any]:
        if index not in self.functions:
            self._build([i for i in range(len(self.kernels)) if i not in self.functions])
        return self.functions[index]

    def _build(self, indices: list[int]) -> None:
        from torch._inductor.codecache import CppPythonBindingsCodeCache as Bindings

        groups = _balanced(indices, [len(self.kernels[i][1]) for i in indices], self.workers)
        try:
            pending = [(group, Bindings.load_async(pooled_source([self.kernels[i] for i in group]),
                                                   "cpu", submit_fn=self.submit))
                       for group in groups]
            for group, load in pending:
                module = load()
                for n, i in enumerate(group):
                    self.functions[i] = getattr(module, f"{_ENTRY}_{n}")
        except Exception as error:  # noqa: BLE001 - inductor's own path is always there
            log.warning("pooled CPU kernel build failed (%s); building each kernel alone",
                        str(error).splitlines()[0] if str(error) else type(error).__name__)
            for i in indices:
                if i not in self.functions:
                    self.functions[i] = Bindings.load_pybinding(*self.kernels[i])


class PooledKernel(CodeCacheFuture):
    """A kernel of a pool: a future (so inductor's own wait resolves it) whose result is
    the kernel's Python-callable binding, built with the rest of its pool."""

    def __init__(self, pool: _Pool, index: int) -> None:
        self.pool, self.index = pool, index

    def result(self, timeout: float | None = None) -> Callable[..., Any]:
        return self.pool.function(self.index)


def _balanced(indices: list[int], sizes: list[int], groups: int) -> list[list[int]]:
    """``indices`` in at most ``groups`` lists of about equal source size, order kept."""
    buckets: list[list[int]] = [[] for _ in range(min(groups, len(indices)))]
    loads = [0] * len(buckets)
    for i, size in sorted(zip(indices, sizes), key=lambda p: -p[1]):
        k = loads.index(min(loads))
        buckets[k].append(i)
        loads[k] += size
    return [sorted(b) for b in buckets if b]


_EXTERN_C = re.compile(r'extern\s+"C"\s*')


def pooled_source(kernels: list[tuple[list[str], str]]) -> str:
    """One C++ source for ``kernels`` (argument types, inductor's source): each source's
    includes hoisted to the top, the rest in a namespace of its own, and a Python module
    named as inductor's loader expects, with one function ``kernel_<n>`` per kernel."""
    includes: list[str] = []
    bodies, methods, wrappers = [], [], []
    for n, (argtypes, source) in enumerate(kernels):
        lines = source.splitlines()
        hoisted = [ln for ln in lines if ln.lstrip().startswith("#include")]
        includes += [ln for ln in dict.fromkeys(hoisted) if ln not in includes]
        body = "\n".join(ln for ln in lines if ln not in hoisted)
        bodies.append(f"namespace comera_pool_{n} {{\n{_EXTERN_C.sub('', body)}\n}}")
        args = ", ".join(f"parse_arg<{t.replace('const ', '')}>(args, {k})"
                         for k, t in enumerate(argtypes))
        wrappers.append(_WRAPPER.format(n=n, count=len(argtypes), args=args, entry=_ENTRY))
        methods.append(f'{{"{_ENTRY}_{n}", {_ENTRY}_{n}_py, METH_VARARGS, ""}},')
    return "\n".join([*includes, *bodies, _BINDINGS_HEAD, *wrappers,
                      _BINDINGS_TAIL.replace("@METHODS@", "\n    ".join(methods))
                      .replace("@ENTRY@", _ENTRY)])


# The binding protocol is inductor's (``CppPythonBindingsCodeCache``): tensors reach the
# kernel as data pointers through a function whose address it passes in an environment
# variable, and the module is named after the entry point.
_BINDINGS_HEAD = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <cerrno>
#include <cstdlib>
#include <stdexcept>

static void* (*_torchinductor_pyobject_tensor_data_ptr)(PyObject* obj);

template <typename T> static inline T parse_arg(PyObject* args, size_t n) {
    static_assert(std::is_pointer_v<T>, "arg type must be pointer or long");
    return static_cast<T>(_torchinductor_pyobject_tensor_data_ptr(PyTuple_GET_ITEM(args, n)));
}
template <> inline int64_t parse_arg<int64_t>(PyObject* args, size_t n) {
    auto result = PyLong_AsSsize_t(PyTuple_GET_ITEM(args, n));
    if (result == -1 && PyErr_Occurred()) [[unlikely]]
        throw std::runtime_error("expected int arg");
    return result;
}
template <> inline uintptr_t parse_arg<uintptr_t>(PyObject* args, size_t n) {
    auto result = PyLong_AsVoidPtr(PyTuple_GET_ITEM(args, n));
    if (result == reinterpret_cast<void*>(-1) && PyErr_Occurred()) [[unlikely]]
        throw std::runtime_error("expected int arg");
    return reinterpret_cast<uintptr_t>(result);
}
template <> inline float parse_arg<float>(PyObject* args, size_t n) {
    auto result = PyFloat_AsDouble(PyTuple_GET_ITEM(args, n));
    if (result == -1.0 && PyErr_Occurred()) [[unlikely]]
        throw std::runtime_error("expected float arg");
    return static_cast<float>(result);
}
"""

_WRAPPER = r"""
static PyObject* {entry}_{n}_py(PyObject* self, PyObject* args) {{
    try {{
        if (!PyTuple_CheckExact(args) || PyTuple_GET_SIZE(args) != {count}) [[unlikely]]
            throw std::runtime_error("requires a tuple of {count} args");
        comera_pool_{n}::{entry}({args});
        Py_RETURN_NONE;
    }} catch (std::exception const& e) {{
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return nullptr;
    }} catch (...) {{
        PyErr_SetString(PyExc_RuntimeError, "unhandled error");
        return nullptr;
    }}
}}
"""

_BINDINGS_TAIL = r"""
static PyMethodDef py_methods[] = {
    @METHODS@
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef py_module = {PyModuleDef_HEAD_INIT, "@ENTRY@", NULL, -1, py_methods};

PyMODINIT_FUNC PyInit_@ENTRY@(void) {
    const char* str_addr = std::getenv("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR");
    if (!str_addr) {
        PyErr_SetString(PyExc_RuntimeError, "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR must be set");
        return nullptr;
    }
    char* end = nullptr;
    errno = 0;
    uintptr_t addr = std::strtoull(str_addr, &end, 10);
    if (errno != 0 || end == str_addr || addr == 0) {
        PyErr_SetString(PyExc_RuntimeError, "bad _TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR");
        return nullptr;
    }
    _torchinductor_pyobject_tensor_data_ptr =
        reinterpret_cast<decltype(_torchinductor_pyobject_tensor_data_ptr)>(addr);
    return PyModule_Create(&py_module);
}
"""


@contextlib.contextmanager
def pooled_kernels(enabled: bool = True) -> Iterator[None]:
    """Within: each generated module's CPU kernels are built in pools (module docstring);
    ``enabled=False`` changes nothing."""
    from torch._inductor.async_compile import AsyncCompile, get_compile_threads

    if not enabled:
        yield
        return
    bind, wait = AsyncCompile.cpp_pybinding, AsyncCompile.wait

    def pooled_bind(self: Any, argtypes: list[str], source_code: str) -> PooledKernel:
        pool = self.__dict__.get("_comera_pool")
        if pool is None:
            workers = get_compile_threads()  # one: build in this process, as inductor does
            pool = self.__dict__["_comera_pool"] = _Pool(self.submit if workers > 1 else None,
                                                         workers)
        return pool.add(argtypes, source_code)

    def resolving_wait(self: Any, scope: dict[str, Any]) -> None:
        for name, value in list(scope.items()):
            if isinstance(value, PooledKernel):
                scope[name] = value.result()
        wait(self, scope)

    AsyncCompile.cpp_pybinding, AsyncCompile.wait = pooled_bind, resolving_wait
    try:
        yield
    finally:
        AsyncCompile.cpp_pybinding, AsyncCompile.wait = bind, wait
