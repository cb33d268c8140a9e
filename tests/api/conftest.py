"""A tiny random Llama with a character tokenizer and a chat template, so text APIs run in seconds."""

from __future__ import annotations

import time

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from splitinfer.model.prepare import prepare
from splitinfer.model.shards import load_cloud
from splitinfer.model.source import SourceModel

from tiny import tiny_model

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}<eos>\n{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def char_tokenizer() -> PreTrainedTokenizerFast:
    """96 ids: <eos> = 0, then printable ASCII 32..125 and a newline; one character per token."""
    chars = [chr(c) for c in range(32, 126)] + ["\n"]
    vocab = {"<eos>": 0, **{c: i + 1 for i, c in enumerate(chars)}}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    inner.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    inner.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="<eos>", unk_token="?")
    tok.chat_template = CHAT_TEMPLATE
    return tok


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
