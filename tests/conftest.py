"""The suite's user cache (trace pieces and what-if answers, kvbench.trace.cache) is a folder of its
own, not the user's ~/.cache/kvbench: subprocesses inherit it."""
from __future__ import annotations

import os
import tempfile

import pytest


@pytest.fixture(scope="session", autouse=True)
def _own_user_cache():
    with tempfile.TemporaryDirectory(prefix="kvbench-test-cache-") as home:
        before = os.environ.get("XDG_CACHE_HOME")
        os.environ["XDG_CACHE_HOME"] = home
        try:
            yield home
        finally:
            if before is None:
                os.environ.pop("XDG_CACHE_HOME", None)
            else:
                os.environ["XDG_CACHE_HOME"] = before
