"""Host memory on CPU: under reuse, freed large blocks stay in the heap, so a step that
allocates the same large activations again does not fault their pages in anew; under
release, they go back to the OS at once."""

import subprocess
import sys

import pytest
import torch

import comera_compile.compile as cc
from comera_compile.compile.host_memory import (
    host_memory_mode,
    reusing_freed_host_memory,
    set_host_memory,
)
from comera_compile.nn import TTLinear

glibc_only = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not set_host_memory("release"),
    reason="mallopt needs glibc",
)


@pytest.fixture(autouse=True)
def _allocator_restored():
    before = host_memory_mode()
    yield
    set_host_memory(before or "release")
    torch._dynamo.reset()


FAULTS = """
import resource, torch
from comera_compile.compile.host_memory import set_host_memory

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
from comera_compile.compile.host_memory import release_free_heap, set_host_memory

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
    assert cc.parse_options({}).host_memory is None
    assert cc.parse_options({"host_memory": "release"}).host_memory == "release"
    with pytest.raises(ValueError, match="must be one of"):
        set_host_memory("keep")
    with pytest.raises(ValueError, match="'host_memory' must be one of"):
        cc.parse_options({"host_memory": "keep"})


MODES = """
import sys, torch
from comera_compile.compile.host_memory import host_memory_mode, set_host_memory

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


@glibc_only
@pytest.mark.parametrize(
    "options, mode, cache_builds",
    [({}, "cache", True), ({"memory": "low"}, "cache", True),
     ({}, "reuse", False), ({"memory": "low"}, "release", False),
     ({"host_memory": "release"}, "release", True),
     ({"memory": "low", "host_memory": "reuse"}, "reuse", True)],
)
def test_cpu_graphs_take_the_block_cache_and_without_it_reuse_or_release(
        options, mode, cache_builds, monkeypatch):
    from comera_compile.compile import block_cache

    if not cache_builds:  # a machine without a C++ compiler
        monkeypatch.setattr(block_cache, "install", lambda *a, **k: False)
    elif not block_cache.install():
        pytest.skip("the block cache cannot be built here")
    set_host_memory("reuse" if mode == "release" else "release")
    torch.manual_seed(0)
    model = torch.nn.Sequential(TTLinear(64, 64, ranks=4), torch.nn.ReLU())
    compiled = torch.compile(model, backend="comera", options={"inductor": False, **options})
    compiled(torch.randn(4, 64)).sum().backward()
    assert host_memory_mode() == mode
    assert reusing_freed_host_memory() is (mode != "release")
    assert block_cache.active() is (mode == "cache")


def test_each_inductor_compile_on_cpu_releases_the_free_heap(monkeypatch):
    """Forward and backward are two inductor compiles: the free heap is released after each."""
    import comera_compile.compile.backend as backend

    calls = []
    monkeypatch.setattr(backend, "release_free_heap", lambda: calls.append(1) or True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(TTLinear(64, 64, ranks=4), torch.nn.ReLU())
    x = torch.randn(4, 64)
    out = torch.compile(model, backend="comera")(x)
    out.sum().backward()
    torch.testing.assert_close(out, model(x))
    assert len(calls) == 2


def test_low_memory_on_cpu_hints_huge_pages_once(monkeypatch, caplog):
    import logging

    import comera_compile.compile.backend as backend

    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    monkeypatch.setattr(backend, "_hinted_huge_pages", False)
    set_host_memory("release")
    model = torch.nn.Sequential(TTLinear(64, 64, ranks=4), torch.nn.ReLU())
    with caplog.at_level(logging.INFO, logger="comera_compile"):
        for width in (4, 5):  # two graphs, one hint
            torch._dynamo.reset()
            compiled = torch.compile(model, backend="comera", options={
                "inductor": False, "memory": "low", "host_memory": "release"})
            compiled(torch.randn(width, 64)).sum().backward()
    hints = [r for r in caplog.records if "THP_MEM_ALLOC_ENABLE=1" in r.getMessage()]
    assert len(hints) == 1
