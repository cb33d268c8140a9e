"""A tiny random Llama with a character tokenizer and a chat template, so text APIs run in seconds."""

from __future__ import annotations

import time

import pytest

from splitinfer.model.prepare import prepare
from splitinfer.model.shards import load_cloud
from splitinfer.model.source import SourceModel

from tiny import char_tokenizer, tiny_model

@pytest.fixture(scope="session")
def chat_shards(tmp_path_factory):
    model = tiny_model("llama", seed=3)
    model.config.eos_token_id = 0  # the tokenizer's <eos>, not LlamaConfig's default 2 (a printable character here)
    out = tmp_path_factory.mktemp("api") / "tiny-chat"
    prepare(SourceModel("tiny-chat", model.config, model, char_tokenizer()), out, 2, 2, "float32")
    return out


@pytest.fixture(scope="session")
def cloud_server(chat_shards):
    from splitinfer.cloud.server import ServerThread

    with ServerThread(load_cloud(chat_shards / "cloud")) as server:
        yield server
