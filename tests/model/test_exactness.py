"""Split greedy decoding equals the monolithic HF model's greedy decoding, token for token (float32 wire)."""

from __future__ import annotations

import pytest
import torch

from splitinfer.cloud.server import ServerThread
from splitinfer.clients import open_client
from splitinfer.local.session import ClientConfig
from splitinfer.model.shards import load_cloud

from tiny import assert_local_only_matches_hf, hf_greedy, prepare_tiny

PROMPT = [3, 17, 42, 5, 88, 21, 9, 60, 33, 7, 14, 2, 71]
NEW_TOKENS = 24


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("head,tail", [(1, 1), (2, 2), (4, 1), (1, 4)])
def test_local_only_matches_hf_generate(tmp_path, family, head, tail):
    model, shards = prepare_tiny(tmp_path, family, head, tail)
    assert_local_only_matches_hf(model, shards, PROMPT, NEW_TOKENS)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_split_over_websocket_matches_hf_generate(tmp_path, family):
    model, shards = prepare_tiny(tmp_path, family, 2, 1)
    expected = hf_greedy(model, PROMPT, NEW_TOKENS)
    # A prefill chunk smaller than the prompt exercises chunking and the lazy commit of every chunk.
    config = ClientConfig(wire_dtype="float32", prefill_chunk=5)
    with ServerThread(load_cloud(shards / "cloud")) as server:
        client = open_client(shards / "local", server.url, config, allow_public_weights=True, checks=False)
        got = client.generate(PROMPT, max_new_tokens=NEW_TOKENS, stop_ids=set(), strategy="sequential")
    assert got.token_ids == expected
    assert got.stats["prefill_messages"] == 3
    assert got.stats["steps"] == NEW_TOKENS - 1


def test_split_logprobs_match_monolithic(tmp_path):
    model, shards = prepare_tiny(tmp_path, "llama", 2, 2)
    got = open_client(local_only=True, shards=shards).generate(PROMPT, max_new_tokens=8, stop_ids=set())
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + got.token_ids[:-1]])).logits[0, len(PROMPT) - 1 :]
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(got.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(got.logprobs), expected, atol=1e-4)


def test_float16_wire_stays_close(tmp_path):
    """float16 on the wire moves logits a little; on a tiny peaked model the tokens stay the same."""
    model, shards = prepare_tiny(tmp_path, "llama", 2, 2)
    expected = hf_greedy(model, PROMPT, NEW_TOKENS)
    with ServerThread(load_cloud(shards / "cloud")) as server:
        got = open_client(shards / "local", server.url, allow_public_weights=True, checks=False).generate(PROMPT, max_new_tokens=NEW_TOKENS, stop_ids=set())
    assert got.token_ids == expected
    assert got.stats["wire_dtype"] == "float16"


def test_stop_token_ends_generation(tmp_path):
    model, shards = prepare_tiny(tmp_path, "llama", 1, 1)
    expected = hf_greedy(model, PROMPT, NEW_TOKENS)
    stop = expected[5]
    got = open_client(local_only=True, shards=shards).generate(PROMPT, max_new_tokens=NEW_TOKENS, stop_ids={stop})
    assert got.finish_reason == "stop"
    assert got.token_ids == expected[: expected.index(stop) + 1]
