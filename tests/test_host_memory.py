"""Host memory on CPU: nothing process-wide changes unless asked for; under reuse, freed
large blocks stay in the heap, so a step that allocates the same large activations again
does not fault their pages in anew; under release, they go back to the OS at once.

Every test that changes the real allocator or ``mallopt`` runs in a fresh interpreter; the
tests in this process see a stand-in ``mallopt`` that records and changes nothing."""

import json
import subprocess
import sys

import pytest
import torch

from comera_compile.compile.cpu import host_memory
from comera_compile.compile.cpu.host_memory import (
    host_memory_mode,
    reusing_freed_host_memory,
    set_host_memory,
)
from comera_compile.config import CompileOptions
from comera_compile.nn import TTLinear

glibc_only = pytest.mark.skipif(
    not sys.platform.startswith("linux") or host_memory._mallopt() is None,
    reason="mallopt needs glibc",
)


@pytest.fixture(autouse=True)
def _no_real_mallopt(monkeypatch):
    """This process keeps glibc's own settings: a stand-in mallopt, the state put back."""
    import comera_compile.compile.backend as backend

    calls = []
    monkeypatch.setattr(host_memory, "_mallopt", lambda: lambda *a: calls.append(a) or 1)
    monkeypatch.setattr(host_memory, "_state", {"mode": None, "mallopt_calls": 0})
    monkeypatch.setattr(backend, "_host_memory_request", {"mode": None})
    monkeypatch.setattr(backend, "_host_memory_warned", set())
    yield calls
    torch._dynamo.reset()


FAULTS = """
import resource, torch
from comera_compile.compile.cpu.host_memory import set_host_memory

def faults_per_step(steps=4):
    # minor page faults per 'step' that allocates, touches and frees an 8 MiB tensor
    torch.ones(2 * 2**20)  # first touch, outside the count
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(steps):
        torch.ones(2 * 2**20)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start) / steps

assert set_host_memory("release")
fresh = faults_per_step()
assert set_host_memory("reuse")
# glibc now and then faults part of a reused heap block in again: the best of three rounds
print(fresh, min(faults_per_step() for _ in range(3)))
"""


@glibc_only
def test_reuse_removes_the_page_faults_of_a_repeated_large_allocation():
    # a fresh interpreter: the heap layout earlier tests leave behind would blur the count
    done = subprocess.run([sys.executable, "-c", FAULTS], capture_output=True, text=True,
                          check=True)
    fresh, reused = map(float, done.stdout.split())
    assert fresh > 1000  # 8 MiB in 4 KiB pages is 2048 (fewer with huge pages)
    assert reused < 0.05 * fresh


RELEASE = """
import torch
from comera_compile.compile.cpu.host_memory import release_free_heap, set_host_memory

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

assert set_host_memory("reuse")
start = rss_mb()
blocks = [torch.ones(2**18) for _ in range(200)]  # 200 MiB of 1 MiB blocks, touched
del blocks
kept = rss_mb() - start
assert release_free_heap()
print(kept, rss_mb() - start)
"""


@glibc_only
def test_release_free_heap_hands_back_what_reuse_keeps():
    """Under reuse, freed blocks stay resident until ``release_free_heap`` (which the backend
    calls after each compile, so the compiler's garbage never counts as the model's)."""
    done = subprocess.run([sys.executable, "-c", RELEASE], capture_output=True, text=True,
                          check=True)
    kept, released = map(float, done.stdout.split())
    assert kept > 180  # the heap kept the 200 MiB
    assert released < 20


def test_host_memory_option_is_checked_at_the_door():
    assert CompileOptions.from_backend_options({}).host_memory == "auto"
    assert CompileOptions.from_backend_options({"host_memory": None}).host_memory == "off"
    assert CompileOptions.from_backend_options(
        {"host_memory": "release"}).host_memory == "release"
    with pytest.raises(ValueError, match="must be one of"):
        set_host_memory("keep")
    with pytest.raises(ValueError, match="'host_memory' must be one of"):
        CompileOptions.from_backend_options({"host_memory": "keep"})


MODES = """
import sys, torch
from comera_compile.compile.cpu.host_memory import host_memory_mode, set_host_memory

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

assert set_host_memory(sys.argv[1]) and host_memory_mode() == sys.argv[1]
torch.ones(8 * 2**18)  # a freed 8 MiB block: glibc's own threshold would now rise to 8 MiB
start = rss_mb()
blocks = [torch.ones(2**18) for _ in range(200)]  # 200 MiB of 1 MiB blocks, touched
del blocks[::2]  # every other block freed: holes the heap cannot trim from its top
print(rss_mb() - start)
"""


@glibc_only
@pytest.mark.parametrize("mode, low, high", [("reuse", 180, 220), ("release", 80, 120)])
def test_release_unmaps_freed_blocks_that_reuse_keeps(mode, low, high):
    done = subprocess.run([sys.executable, "-c", MODES, mode], capture_output=True,
                          text=True, check=True)
    resident = float(done.stdout)
    assert low < resident < high  # 100 MiB live; reuse keeps the 100 MiB freed too


DEFAULTS = """
import json, torch
from torch import nn
import comera_compile as cc
from comera_compile.compile.cpu import block_cache, host_memory

calls = []
real = host_memory._mallopt
host_memory._mallopt = lambda: (lambda *a: calls.append(a) or real()(*a))

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

torch.manual_seed(0)
model = cc.optimize(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)), 0.5)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    model(torch.randn(16, 64)).sum().backward()
    opt.step()
    opt.zero_grad()
with open("/proc/self/maps") as f:
    mapped = "block_cache" in f.read()
# 64 MiB is above glibc's largest adaptive mmap threshold (32 MiB): under its own settings
# the block is unmapped when freed; under reuse or the cache it would stay resident
start = rss_mb()
big = torch.ones(16 * 2**20)
held = rss_mb() - start
del big
print(json.dumps({"mallopt": len(calls), "recorded": host_memory.mallopt_calls(),
                  "mode": host_memory.host_memory_mode(), "cache_loaded": mapped,
                  "cache_active": block_cache.active(),
                  "built": block_cache._library.cache_info().currsize,
                  "held": held, "after_free": rss_mb() - start}))
"""


@glibc_only
def test_default_compile_leaves_the_allocator_and_malloc_settings_alone():
    done = subprocess.run([sys.executable, "-c", DEFAULTS], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["mallopt"] == 0 and out["recorded"] == 0  # glibc's settings untouched
    assert out["mode"] is None
    assert not out["cache_loaded"] and not out["cache_active"] and out["built"] == 0
    assert out["held"] > 60  # the 64 MiB block was touched
    assert out["after_free"] < 16  # and handed back when freed: glibc's own behaviour


AUTO = """
import json, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
import comera_compile as cc
from comera_compile.compile.cpu import block_cache
from comera_compile.compile.cpu.host_memory import host_memory_mode

shape = [int(n) for n in sys.argv[1].split('x')]
options, path = json.loads(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, use_cache=False))
if path.startswith("load:"):
    model = cc.load(path[5:])
else:
    config = cc.CompressionConfig(budget=0.25, compile=False, compile_options=options)
    example = (torch.zeros(*shape, dtype=torch.long),)
    model = cc.optimize(model, config, example_inputs=example)
    if path:
        cc.save(model, path)
print(json.dumps([cc.passes.report_of(model).recompute, host_memory_mode(), block_cache.active()]))
"""


@glibc_only
def test_optimize_sets_the_block_cache_where_a_cpu_model_recomputes_its_bonds(tmp_path):
    """The default ``host_memory="auto"``: bond recomputation on the CPU brings the block cache
    for the process (a saved model loads back with it); no recomputation, or ``"off"``,
    leaves torch's allocator alone."""
    from comera_compile.compile.cpu import block_cache

    if block_cache._library() is None:
        pytest.skip("the block cache cannot be built here")

    def run(shape, options=None, path=""):
        done = subprocess.run([sys.executable, "-c", AUTO, shape, json.dumps(options or {}),
                               str(path)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    assert run("16x128", path=tmp_path / "m") == ["bonds", "cache", True]
    assert run("1x1", path=f"load:{tmp_path / 'm'}") == ["bonds", "cache", True]
    assert run("1x4") == [None, None, False]  # a step that keeps little: nothing to recompute
    assert run("16x128", {"host_memory": "off"}) == ["bonds", None, False]


OPT_IN = """
import json, torch
from comera_compile.compile.cpu import block_cache
from comera_compile.compile.cpu.host_memory import (
    host_memory_mode, reusing_freed_host_memory, restore_host_memory)
from comera_compile.nn import TTLinear

cases = json.loads(%r)
real_install = block_cache.install
out = []
for options, builds in cases:
    block_cache.install = real_install if builds else (lambda *a, **k: False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(TTLinear(64, 64, ranks=4), torch.nn.ReLU())
    compiled = torch.compile(model, backend="comera", options={"inductor": False, **options})
    compiled(torch.randn(4, 64)).sum().backward()
    out.append([host_memory_mode(), reusing_freed_host_memory(), block_cache.active()])
    restore_host_memory()
    torch._dynamo.reset()
print(json.dumps(out))
"""


@glibc_only
def test_cpu_graphs_take_the_host_memory_mode_asked_for_and_only_then():
    from comera_compile.compile.cpu import block_cache

    if block_cache._library() is None:
        pytest.skip("the block cache cannot be built here")
    cases = [  # options, whether the cache builds (no C++ compiler: False), mode expected
        ({}, True, None), ({"host_memory": "off"}, True, None),
        ({"host_memory": "cache"}, True, "cache"),
        ({"memory": "low", "host_memory": "cache"}, True, "cache"),
        ({"host_memory": "cache"}, False, "reuse"),
        ({"memory": "low", "host_memory": "cache"}, False, "release"),
        ({"host_memory": "release"}, True, "release"),
        ({"memory": "low", "host_memory": "reuse"}, True, "reuse"),
    ]
    script = OPT_IN % json.dumps([[o, b] for o, b, _ in cases])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    for (options, builds, mode), (got, reusing, active) in zip(
            cases, json.loads(done.stdout.strip().splitlines()[-1])):
        assert got == mode, (options, builds)
        assert reusing is (mode in ("cache", "reuse"))
        assert active is (mode == "cache")


def test_the_first_mode_asked_for_stays_and_another_model_asking_otherwise_is_warned(
        _no_real_mallopt):
    def compile_step(**options):
        torch._dynamo.reset()
        model = torch.nn.Sequential(TTLinear(64, 64, ranks=4), torch.nn.ReLU())
        compiled = torch.compile(model, backend="comera", options={"inductor": False, **options})
        compiled(torch.randn(4, 64)).sum().backward()

    compile_step()  # the default: nothing changes
    assert host_memory_mode() is None and _no_real_mallopt == []
    compile_step(host_memory="reuse")
    assert host_memory_mode() == "reuse" and len(_no_real_mallopt) == 2
    with pytest.warns(UserWarning, match="host_memory='reuse' is in effect"):
        compile_step(host_memory="release")
    assert host_memory_mode() == "reuse" and len(_no_real_mallopt) == 2  # left as it was
    with pytest.warns(UserWarning, match="host_memory='off' is not applied"):
        compile_step()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compile_step(host_memory="reuse")  # the same mode: nothing to say
        compile_step()  # the same pair again: warned once already
    assert host_memory.restore_host_memory() and host_memory_mode() is None
    compile_step(host_memory="release")  # after restoring, a new mode can be set
    assert host_memory_mode() == "release"


def test_a_mode_set_for_the_process_on_purpose_is_kept_quietly_by_default_compiles(
        _no_real_mallopt):
    import warnings

    assert set_host_memory("reuse")
    model = torch.nn.Sequential(TTLinear(64, 64, ranks=4), torch.nn.ReLU())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compiled = torch.compile(model, backend="comera", options={"inductor": False})
        compiled(torch.randn(4, 64)).sum().backward()
    assert host_memory_mode() == "reuse" and reusing_freed_host_memory()


def test_each_inductor_compile_on_cpu_releases_the_free_heap(monkeypatch):
    """Forward and backward are two inductor compiles: the free heap is released after each.
    (Caches off: a graph another test compiled is served from them, and nothing compiles.)"""
    import comera_compile.compile.backend as backend

    calls = []
    monkeypatch.setattr(backend, "release_free_heap", lambda: calls.append(1) or True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(TTLinear(64, 64, ranks=4), torch.nn.ReLU())
    x = torch.randn(4, 64)
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True):
        out = torch.compile(model, backend="comera")(x)
        out.sum().backward()
    torch.testing.assert_close(out, model(x))
    assert len(calls) == 2


def test_low_memory_on_cpu_hints_huge_pages_once(monkeypatch, caplog):
    import logging

    import comera_compile.compile.backend as backend

    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    monkeypatch.setattr(backend, "_hinted_huge_pages", False)
    model = torch.nn.Sequential(TTLinear(64, 64, ranks=4), torch.nn.ReLU())
    with caplog.at_level(logging.INFO, logger="comera_compile"):
        for width in (4, 5):  # two graphs, one hint
            torch._dynamo.reset()
            compiled = torch.compile(model, backend="comera", options={
                "inductor": False, "memory": "low", "host_memory": "release"})
            compiled(torch.randn(width, 64)).sum().backward()
    hints = [r for r in caplog.records if "THP_MEM_ALLOC_ENABLE=1" in r.getMessage()]
    assert len(hints) == 1
