"""The CPU block cache: freed blocks of 1 MiB or more come back for the next request of the
same size, with no page faults; sizes no longer asked for are unmapped; small blocks and
uninstalling leave torch's own allocator in charge. Each test runs in a fresh interpreter,
so the allocator it installs never outlives it."""

import json
import subprocess
import sys

import pytest
import torch

from comera_compile.compile.cpu import block_cache
from comera_compile.planner import native

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the block cache is built for Linux"
)

PRELUDE = """
import json, resource, torch
from comera_compile.compile.cpu import block_cache as bc

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
"""


def run(body: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PRELUDE + body], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module", autouse=True)
def _built():
    if block_cache._library() is None:  # builds it once for every child below
        pytest.skip("the block cache cannot be built here (no C++ compiler)")


def test_a_repeated_step_reuses_its_blocks_without_page_faults():
    out = run("""
assert bc.install()
def step():  # 8 MiB and 3 MiB activations, touched and freed, as a training step does
    a = torch.ones(2048, 1024)
    b = torch.ones(768, 1024) * 2
    c = torch.nn.functional.gelu(b)  # a kernel that takes raw scratch space as well
    return float(a.sum() + b.sum() + c.sum())
step()
start, s0 = faults(), bc.stats()
values = [step() for _ in range(5)]
s1 = bc.stats()
print(json.dumps({"faults": (faults() - start) / 5, "hits": s1.hits - s0.hits,
                  "misses": s1.misses - s0.misses, "values": values, "mapped": s1.mapped,
                  "active": bc.active()}))
""")
    assert out["active"]
    assert out["misses"] == 0 and out["hits"] >= 20  # every large block came from the cache
    assert out["faults"] < 50  # 11 MiB in 4 KiB pages would be ~2,800 faults per step
    assert len(set(out["values"])) == 1
    assert out["mapped"] < 16 * 2**20  # only the step's own blocks are held


def test_without_the_cache_the_same_step_faults_its_pages_in_again():
    out = run("""
from comera_compile.compile.cpu.host_memory import set_host_memory
assert set_host_memory("release")
torch.ones(2048, 1024)
start = faults()
for _ in range(5):
    torch.ones(2048, 1024).sum()
print(json.dumps({"faults": (faults() - start) / 5}))
""")
    assert out["faults"] > 1000  # the baseline the cache removes: 8 MiB is 2,048 pages


def test_blocks_are_reused_by_exact_size_and_small_ones_pass_through():
    out = run("""
assert bc.install()
a = torch.empty(3 * 2**20, dtype=torch.uint8); del a  # 3 MiB, kept
b = torch.empty(3 * 2**20, dtype=torch.uint8)         # the same size: the kept block
c = torch.empty(5 * 2**20, dtype=torch.uint8)         # another size: a new block
s = bc.stats()
small = torch.empty(1000)                               # 4 KB: torch's own allocator
s2 = bc.stats()
print(json.dumps({"misses": s.misses, "hits": s.hits, "kept": s.kept, "mapped": s.mapped,
                  "small_counted": s2.misses + s2.hits - s.misses - s.hits}))
""")
    assert out == {"misses": 2, "hits": 1, "kept": 0, "mapped": 8 * 2**20, "small_counted": 0}


def test_a_miss_past_the_peak_in_use_resizes_a_kept_block_instead_of_mapping_more():
    out = run("""
assert bc.install()
a = torch.empty(3 * 2**20, dtype=torch.uint8)
a[:] = 7                                               # its pages are in
del a                                                  # kept: the peak in use is 3 MiB
before = faults()
b = torch.empty(5 * 2**20, dtype=torch.uint8)         # 5 MiB would map 8: the 3 MiB grows
b[:] = 1
s = bc.stats()
print(json.dumps({"misses": s.misses, "recycled": s.recycled, "kept": s.kept,
                  "mapped": s.mapped, "faults": faults() - before}))
""")
    assert out["misses"] == 2 and out["recycled"] == 1
    assert out["kept"] == 0 and out["mapped"] == 5 * 2**20  # not 8: no size kept idle
    assert out["faults"] < 0.8 * 5 * 256  # the 3 MiB it had stay in (1,280 pages anew)


def test_sizes_no_longer_asked_for_are_unmapped_after_max_idle_requests():
    out = run("""
assert bc.install(max_idle=3)
big = torch.empty(64 * 2**20, dtype=torch.uint8)  # in use beside the next one: a peak of
old = torch.empty(4 * 2**20, dtype=torch.uint8)   # 68 MiB, so the 1.5x-peak bound keeps all
del old, big                                       # kept, then never asked for again
before = bc.stats()
for mib in range(1, 6):                            # a new shape: five new sizes
    torch.empty(mib * 2**20 + 4096, dtype=torch.uint8)
s = bc.stats()
again = torch.empty(4 * 2**20, dtype=torch.uint8)  # the old size once more: mapped anew
print(json.dumps({"before": before.kept, "before_unmapped": before.unmapped,
                  "unmapped": s.unmapped, "kept": s.kept,
                  "old_size_missed": bc.stats().misses - s.misses}))
""")
    assert out["before"] == 68 * 2**20 and out["before_unmapped"] == 0
    assert out["unmapped"] >= 2  # the 64 MiB and 4 MiB blocks went back to the OS, idle
    assert out["old_size_missed"] == 1
    assert out["kept"] <= sum((m * 2**20 + 4096) for m in range(1, 6))


def test_blocks_of_an_old_shape_age_out_while_every_later_request_hits():
    out = run("""
assert bc.install(max_idle=16)
old = torch.empty(8 * 2**20, dtype=torch.uint8); del old  # the old shape's block, kept
for _ in range(200):  # the new shape: one miss, then every request hits
    torch.empty(2 * 2**20, dtype=torch.uint8)
s = bc.stats()
print(json.dumps({"kept": s.kept, "misses": s.misses, "hits": s.hits, "mapped": s.mapped,
                  "gone": s.unmapped + s.recycled}))
""")
    assert out["misses"] == 2 and out["hits"] == 199
    assert out["gone"] == 1  # the 8 MiB block went back to the OS or became the 2 MiB one
    assert out["kept"] == out["mapped"] == 2 * 2**20


def test_a_fork_while_another_thread_allocates_leaves_the_child_a_working_cache():
    out = run("""
import os, threading, time, warnings
warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads running
torch.set_num_threads(1)
assert bc.install(max_idle=64)
stop = False
def churn():  # holds the cache's mutex much of the time: many kept sizes to walk
    blocks = [torch.empty((1 << 20) + 4096 * i, dtype=torch.uint8) for i in range(64)]
    del blocks
    i = 0
    while not stop:
        torch.empty((1 << 20) + 4096 * (i % 256), dtype=torch.uint8)
        i += 1
thread = threading.Thread(target=churn, daemon=True)
thread.start()
time.sleep(0.2)
stuck = 0
for _ in range(40):
    pid = os.fork()
    if pid == 0:
        torch.empty(3 << 20, dtype=torch.uint8)
        os._exit(0)
    deadline = time.time() + 5
    while time.time() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.01)
    else:
        stuck += 1
        os.kill(pid, 9)
        os.waitpid(pid, 0)
stop = True
thread.join()
print(json.dumps({"stuck": stuck}))
""")
    assert out["stuck"] == 0


PLANT = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
  FILE* f = fopen(MARKER, "w");
  if (f) { fputs("ran", f); fclose(f); }
}
"""


def test_a_library_planted_in_the_build_directory_is_never_loaded(tmp_path, monkeypatch):
    import shutil

    cxx = shutil.which("cc") or shutil.which("gcc")
    if cxx is None:
        pytest.skip("no C compiler to build the planted library")
    monkeypatch.setenv("COMERA_CACHE_DIR", str(tmp_path / "cache"))
    marker = tmp_path / "marker"
    source = tmp_path / "plant.c"
    source.write_text(PLANT)
    directory = native.private_dir(native.build_dir(block_cache.NAME))
    key = native.build_key(block_cache.SOURCE, block_cache._command, torch.__version__)
    target = directory / f"block_cache_{key[:16]}.so"
    subprocess.run([cxx, "-shared", "-fPIC", f'-DMARKER="{marker}"', str(source), "-o",
                    str(target)], check=True)
    # planted next to a hash file of its own making, too: the hash must match the bytes
    target.with_suffix(".sha256").write_text("0" * 64)
    out = run("""
print(json.dumps({"installed": bc.install(), "active": bc.active()}))
""")
    assert not marker.exists()  # the planted constructor never ran
    assert out == {"installed": True, "active": True}  # it was built again and loaded


def test_the_build_directory_is_private(tmp_path, monkeypatch):
    import os
    import stat

    monkeypatch.setenv("COMERA_CACHE_DIR", str(tmp_path / "cache"))
    directory = native.build_dir(block_cache.NAME)
    assert native.private_dir(directory) == directory
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    os.chmod(directory, 0o777)  # loosened: tightened again before any use
    native.private_dir(directory)
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.rmdir(directory)
    os.symlink(elsewhere, directory)  # a link to somewhere else is refused
    with pytest.raises(native.UnsafeCacheDir):
        native.private_dir(directory)
    out = run("""
print(json.dumps({"installed": bc.install()}))
""")
    assert out == {"installed": True}  # built in a private temporary directory instead
    assert list(elsewhere.iterdir()) == []  # nothing was written through the link


def test_cache_dir_off_builds_nothing_on_disk_and_in_no_directory_named_off(tmp_path):
    import os

    env = {**os.environ, "COMERA_CACHE_DIR": "off"}
    done = subprocess.run([sys.executable, "-c", PRELUDE + """
print(json.dumps({"installed": bc.install(), "dir": bc.native.build_dir(bc.NAME)}))
"""], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out == {"installed": True, "dir": None}
    assert list(tmp_path.iterdir()) == []  # no ./off/ in the working directory


def test_a_build_that_cannot_run_falls_back_cleanly(tmp_path):
    """No setuptools (torch's cpp_extension imports it) or a compiler past the timeout:
    install() says False and compiling with host_memory="cache" takes glibc's heap."""
    import os

    slow = tmp_path / "slow-c++"
    slow.write_text("#!/bin/sh\nsleep 60\n")
    slow.chmod(0o755)
    script = PRELUDE + """
import sys, time
from comera_compile.nn import TTLinear
from comera_compile.compile.cpu.host_memory import host_memory_mode
if sys.argv[1] == "no-setuptools":
    sys.modules["setuptools"] = None  # import setuptools raises ModuleNotFoundError
else:
    bc.native.BUILD_TIMEOUT = 2
start = time.time()
installed = bc.install()
took = time.time() - start
model = torch.nn.Sequential(TTLinear(64, 64, ranks=4), torch.nn.ReLU())
compiled = torch.compile(model, backend="comera",
                         options={"inductor": False, "host_memory": "cache"})
compiled(torch.randn(4, 64)).sum().backward()
print(json.dumps({"installed": installed, "took": took, "mode": host_memory_mode()}))
"""
    for case, extra in (("no-setuptools", {}), ("slow-compiler", {"CXX": str(slow)})):
        env = {**os.environ, "COMERA_CACHE_DIR": str(tmp_path / case), **extra}
        done = subprocess.run([sys.executable, "-c", script, case], capture_output=True,
                              text=True, env=env, timeout=120)
        assert done.returncode == 0, (case, done.stderr[-2000:])
        out = json.loads(done.stdout.strip().splitlines()[-1])
        assert out["installed"] is False and out["mode"] == "reuse", case
        assert out["took"] < 30, case


def test_max_kept_zero_unmaps_at_once_and_uninstall_restores_torchs_allocator():
    out = run("""
assert bc.install(max_kept=0)
torch.empty(4 * 2**20, dtype=torch.uint8)
s = bc.stats()
live = torch.ones(2**20)  # 4 MiB in use while the cache is taken out
assert bc.uninstall() and not bc.active()
after = torch.empty(4 * 2**20, dtype=torch.uint8)  # torch's own allocator again
total = float(live.sum())
del live
print(json.dumps({"kept": s.kept, "unmapped": s.unmapped, "total": total,
                  "misses_after": bc.stats().misses, "mapped_after": bc.stats().mapped}))
""")
    assert out["kept"] == 0 and out["unmapped"] == 1
    assert out["total"] == 2**20
    assert out["misses_after"] == 2  # the tensor after uninstalling did not come from it
    assert out["mapped_after"] == 0  # the block in use went back to the OS when freed


def test_sizes_that_change_every_step_keep_at_most_half_again_the_peak_in_use():
    out = run("""
assert bc.install()
for step in range(200):  # a 2 MiB activation whose size changes every step, never reused
    torch.ones(2**19 + 1024 * step).sum()
s = bc.stats()
print(json.dumps({"kept": s.kept, "peak": s.peak_in_use, "misses": s.misses}))
""")
    assert out["misses"] == 200
    assert out["kept"] <= 1.5 * out["peak"]  # without the bound: 200 blocks, 480 MiB
