"""Test-wide settings: plan files go to a temporary cache, never to the user's ~/.cache."""

import os
import tempfile

import pytest
import torch

os.environ.setdefault("COMERA_CACHE_DIR", tempfile.mkdtemp(prefix="comera-test-cache-"))


@pytest.fixture
def one_thread():
    """Tiny matmuls: extra threads only add contention."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
