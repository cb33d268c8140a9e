"""Defaults that work for every supported family: `prepare` records the wire dtype the model needs
(bfloat16 for Gemma 3, whose hidden states overflow float16; float16 otherwise) and a client given no
options uses it. Each family generates over a WebSocket with a default ClientConfig."""

from __future__ import annotations

import json

import pytest
import torch

from splitinfer.cloud.server import ServerThread
from splitinfer.errors import SplitInferError
from splitinfer.clients import open_client
from splitinfer.local.session import ClientConfig
from splitinfer.model.prepare import prepare
from splitinfer.model.shards import load_cloud
from splitinfer.model.source import SourceModel

from tiny import TINY_CONFIGS, prepare_tiny, tiny_model

PROMPT = [3, 17, 42, 5, 88, 21, 9, 60]


def generate(shards, config: ClientConfig = ClientConfig()):
    with ServerThread(load_cloud(shards / "cloud")) as server:
        client = open_client(shards / "local", server.url, config, allow_public_weights=True, checks=False)
        return client, client.generate(PROMPT, max_new_tokens=6, stop_ids=set())


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_every_family_generates_with_no_options(tmp_path, family):
    _, shards = prepare_tiny(tmp_path, family, 2, 2)
    recorded = json.loads((shards / "local" / "manifest.json").read_text())["wire_dtype"]
    assert recorded == ("bfloat16" if family == "gemma3" else "float16")
    client, result = generate(shards)
    assert client.config.wire_dtype == recorded and len(result.token_ids) == 6


def test_gemma3_hidden_states_beyond_float16_need_the_recorded_default(tmp_path):
    model = tiny_model("gemma3")
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(1e6)  # activations past float16's 65504, as real Gemma 3 has
    out = tmp_path / "gemma3-large"
    prepare(SourceModel("tiny-gemma3-large", model.config, model, None), out, 2, 2, "float32")
    _, result = generate(out)  # no options: the shard's bfloat16
    assert len(result.token_ids) == 6
    with pytest.raises(SplitInferError, match="not finite in float16"):
        generate(out, ClientConfig(wire_dtype="float16"))
