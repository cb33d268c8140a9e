"""The public-weights acknowledgement given once (`prepare --allow-public-weights`): recorded in the local
manifest, honoured by later client commands with the warning still printed, void for rewritten weights."""

from __future__ import annotations

import json

import pytest

from splitinfer.cli import main
from splitinfer.cloud.server import ServerThread
from splitinfer.model.shards import load_cloud
from splitinfer.errors import ConfigError
from splitinfer.local.client import check_local_weights
from splitinfer.model.manifest import read_manifest
from splitinfer.public_weights import RECORD, acknowledge, acknowledged

from tiny import prepare_tiny, tiny_model


def test_an_acknowledged_shard_connects_without_the_flag_and_other_weights_void_it(tmp_path):
    _, shards = prepare_tiny(tmp_path, "llama", 2, 2)
    local = shards / "local"
    with pytest.raises(ConfigError, match="prepare --allow-public-weights"):
        check_local_weights(read_manifest(local, "local"), allow_public_weights=False)
    acknowledge(local, "test")
    manifest = read_manifest(local, "local")
    assert acknowledged(manifest) and manifest[RECORD]["given_by"] == "test"
    assert check_local_weights(manifest, allow_public_weights=False) is True  # still public: the caller warns
    manifest["files"]["weights.safetensors"] = "0" * 64  # the weights were rewritten after the acknowledgement
    assert not acknowledged(manifest)
    with pytest.raises(ConfigError):
        check_local_weights(manifest, allow_public_weights=False)


def test_prepare_records_it_and_a_client_command_honours_it_with_the_warning(tmp_path, capsys):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "hf")
    out = tmp_path / "shards"
    assert main(["prepare", "--model", str(tmp_path / "hf"), "--out", str(out), "--allow-public-weights"]) == 0
    assert "recorded in" in capsys.readouterr().out
    assert acknowledged(json.loads((out / "local" / "manifest.json").read_text()))
    # A server of another model: the command gets past the gate and stops at the handshake.
    _, other = prepare_tiny(tmp_path, "llama", 2, 2, seed=5)
    with ServerThread(load_cloud(other / "cloud")) as server:
        for shard, refused in ((out, False), (plain_shards(tmp_path, capsys), True)):
            assert main(["api", "--shard", str(shard / "local"), "--server", server.url, "--port", "0"]) == 2
            err = capsys.readouterr().err
            if refused:
                assert "refusing to connect" in err
            else:
                assert err.startswith("warning: the local layers are the stock public weights"), err
                assert "refusing" not in err and "prepared together" in err


def plain_shards(tmp_path, capsys):
    plain = tmp_path / "plain"
    assert main(["prepare", "--model", str(tmp_path / "hf"), "--out", str(plain)]) == 0
    capsys.readouterr()
    return plain
