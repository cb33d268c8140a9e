"""The one client factory (clients.open_client): each kind builds the client its arguments name, and a client's
construction leaves nothing to patch afterwards (mode and draft head are constructor arguments)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from splitinfer.cloud.server import ServerThread
from splitinfer.clients import open_client
from splitinfer.errors import ConfigError
from splitinfer.inprocess import load_halves
from splitinfer.local.config import ClientConfig
from splitinfer.model.prepare import prepare
from splitinfer.model.shards import load_cloud
from splitinfer.model.source import SourceModel

from tiny import char_tokenizer, prepare_tiny, tiny_model

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


def test_a_remote_generate_reads_the_local_manifest_once_and_runs_the_gate_once(tmp_path, monkeypatch, capsys):
    """The front door once (issue 63): `splitinfer generate` on a split reads OUT/local/manifest.json once, when
    its local half loads, and runs the public-weights check once; the synthetic-weights check, the gate and the
    client all read the manifest that load read."""
    import builtins
    import io

    from splitinfer.cli import main
    from splitinfer.local import client as client_module

    model = tiny_model("llama", seed=3)
    out = tmp_path / "chat"
    prepare(SourceModel("tiny-chat", model.config, model, char_tokenizer()), out, 2, 2, "float32")
    manifest = (out / "local" / "manifest.json").resolve()
    reads, gates = [], []
    real_open, real_check = builtins.open, client_module.check_local_weights

    def counted_open(file, *args, **kwargs):  # Path.read_text and open() both come here
        if isinstance(file, (str, Path)) and Path(file).resolve() == manifest:
            reads.append(file)
        return real_open(file, *args, **kwargs)

    def counted_check(local_manifest, allow_public_weights):
        gates.append(allow_public_weights)
        return real_check(local_manifest, allow_public_weights)

    with ServerThread(load_cloud(out / "cloud")) as server:
        monkeypatch.setattr(builtins, "open", counted_open)
        monkeypatch.setattr(io, "open", counted_open)
        monkeypatch.setattr(client_module, "check_local_weights", counted_check)
        code = main(["generate", "--prompt", "hi", "--no-chat", "--shard", str(out / "local"), "--server", server.url,
                     "--allow-public-weights", "--max-new-tokens", "3", "--json"])
        monkeypatch.undo()
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert json.loads(captured.out)["token_ids"] and len(reads) == 1 and gates == [True]
    assert captured.err.startswith("warning: the local layers are the stock public weights")
