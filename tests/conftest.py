"""Test-wide settings: plan files go to a temporary cache, never to the user's ~/.cache."""

import os
import tempfile

os.environ.setdefault("COMERA_CACHE_DIR", tempfile.mkdtemp(prefix="comera-test-cache-"))
