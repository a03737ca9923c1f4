"""The CPU block cache: freed blocks of 1 MiB or more come back for the next request of the
same size, with no page faults; sizes no longer asked for are unmapped; small blocks and
uninstalling leave torch's own allocator in charge. Each test runs in a fresh interpreter,
so the allocator it installs never outlives it."""

import json
import subprocess
import sys

import pytest

from comera_compile.compile import block_cache

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the block cache is built for Linux"
)

PRELUDE = """
import json, resource, torch
from comera_compile.compile import block_cache as bc

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
from comera_compile.compile.host_memory import set_host_memory
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
b = torch.empty(5 * 2**20, dtype=torch.uint8)         # another size: a new block
s = bc.stats()
small = torch.empty(1000)                               # 4 KB: torch's own allocator
s2 = bc.stats()
print(json.dumps({"misses": s.misses, "hits": s.hits, "kept": s.kept, "mapped": s.mapped,
                  "small_counted": s2.misses + s2.hits - s.misses - s.hits}))
""")
    assert out == {"misses": 2, "hits": 0, "kept": 3 * 2**20, "mapped": 8 * 2**20,
                   "small_counted": 0}


def test_sizes_no_longer_asked_for_are_unmapped_after_max_idle_requests():
    out = run("""
assert bc.install(max_idle=3)
old = torch.empty(4 * 2**20, dtype=torch.uint8); del old  # kept, then never asked for again
before = bc.stats().mapped
for mib in range(1, 6):                                    # a new shape: five new sizes
    torch.empty(mib * 2**20 + 4096, dtype=torch.uint8)
s = bc.stats()
print(json.dumps({"before": before, "unmapped": s.unmapped, "kept": s.kept}))
""")
    assert out["before"] == 4 * 2**20
    assert out["unmapped"] >= 1  # the 4 MiB block went back to the OS
    # what is kept is only recent sizes: at most the last max_idle + 1 of the new ones
    assert out["kept"] <= sum((m * 2**20 + 4096) for m in range(2, 6))


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
