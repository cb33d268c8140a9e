"""The one client factory (clients.open_client): each kind builds the client its arguments name, and a client's
construction leaves nothing to patch afterwards (mode and draft head are constructor arguments)."""

from __future__ import annotations

import pytest

from splitinfer.cloud.server import ServerThread
from splitinfer.clients import open_client
from splitinfer.errors import ConfigError
from splitinfer.inprocess import load_halves
from splitinfer.local.config import ClientConfig
from splitinfer.model.shards import load_cloud

from tiny import prepare_tiny

PROMPT = [3, 17, 42, 5, 88, 21, 9]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return prepare_tiny(tmp_path_factory.mktemp("clients"), "llama", 2, 2)[1]


def test_in_process_from_a_directory_or_from_loaded_halves_gives_the_same_tokens(shards):
    from_dir = open_client(local_only=True, shards=shards)
    from_halves = open_client(local_only=True, halves=load_halves(shards))
    assert from_dir.mode == from_halves.mode == "local-only" and from_halves.draft_head is None
    assert from_dir.config.wire_dtype == "float32"
    want = from_dir.generate(PROMPT, max_new_tokens=6, stop_ids=set(), strategy="sequential").token_ids
    assert from_halves.generate(PROMPT, max_new_tokens=6, stop_ids=set(), strategy="tree").token_ids == want


def test_remote_matches_in_process_and_a_missing_server_is_one_clear_line(shards):
    want = open_client(local_only=True, shards=shards).generate(PROMPT, max_new_tokens=6, stop_ids=set()).token_ids
    with ServerThread(load_cloud(shards / "cloud")) as server:
        client = open_client(shards / "local", server.url, ClientConfig(wire_dtype="float32"),
                             allow_public_weights=True, handshake=True)
        assert client.mode == "split"
        assert client.generate(PROMPT, max_new_tokens=6, stop_ids=set()).token_ids == want
    with pytest.raises(ConfigError, match="--server"):
        open_client(shards / "local", None)
