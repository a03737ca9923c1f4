"""Test-wide settings: plan files go to a temporary cache, never to the user's ~/.cache."""

import os
import sys
import tempfile
from pathlib import Path

if os.environ.get("PYTEST_XDIST_WORKER"):  # parallel workers: a core each, not two threads each
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("COMERA_CACHE_DIR", tempfile.mkdtemp(prefix="comera-test-cache-"))
# the demo models outside the package (examples/dlrm_model.py, examples/minilm_corpus.py)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


@pytest.fixture
def one_thread():
    """Tiny matmuls: extra threads only add contention."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _allocator_left_alone(monkeypatch):
    """``optimize`` sets the block cache for the whole process when a CPU model recomputes its
    bonds (``host_memory="auto"``); the tests in this process keep torch's allocator, and
    ``tests/test_host_memory.py`` checks that default in fresh interpreters."""
    from comera_compile.compile.cpu import host_memory

    monkeypatch.setattr(host_memory, "cache_for_training", lambda model: False)
