"""Multi-turn chat reuses the KV cache: a later turn prefills only its new tokens and matches a fresh session."""

from __future__ import annotations

import pytest

from splitinfer.api.chat import ChatSession, run_chat
from splitinfer.clients import open_client
from splitinfer.local.client import SplitClient
from splitinfer.local.session import ClientConfig

F32 = ClientConfig(wire_dtype="float32", retry_backoff_s=0.05)


@pytest.fixture
def client(chat_shards, cloud_server):
    return SplitClient.connect(chat_shards / "local", cloud_server.url, F32, allow_public_weights=True)


@pytest.mark.parametrize("max_new", [40, 6])  # 6: the first reply is cut by the length limit, not by <eos>
def test_second_turn_prefills_only_new_tokens_and_equals_a_fresh_session(client, cloud_server, max_new, settle):
    chat = ChatSession(client, system="be brief", strategy="tree")
    first = chat.say("hello there", max_new)
    assert first.prefilled_tokens == first.prompt_tokens  # nothing cached yet
    if max_new == 6:
        assert first.finish_reason == "length"
    history_before = list(chat.conversation.history)
    cached_before = chat.conversation.cached_tokens
    assert cached_before == len(history_before) - 1  # the last generated token has not been through the model

    second = chat.say("and then?", 30)
    new_ids = second.prompt_tokens - len(history_before)
    assert second.prefilled_tokens == new_ids + 1  # the new turn plus the previous turn's last token
    assert second.stats["cached_tokens"] == cached_before
    session = chat.conversation.session
    prefill_rows = sum(r.rows for r in session.records if r.kind == "prefill")
    assert prefill_rows == first.prompt_tokens + second.prefilled_tokens  # the cloud never saw turn 1 twice

    # The conversation's tokens are what the chat template gives for the whole conversation ...
    conversation = chat.conversation.history[: second.prompt_tokens]
    assert conversation == chat.tokenizer.apply_chat_template(chat.messages[:-1], add_generation_prompt=True)["input_ids"]
    assert len(cloud_server.server.table) == 1  # both turns in one cloud session
    # ... and a fresh session given all of them generates the same reply.
    fresh = client.generate(conversation, max_new_tokens=30, chat=False)
    assert second.token_ids == fresh.token_ids, (second.token_ids, fresh.token_ids)
    assert second.text == fresh.text
    chat.close()
    assert settle(lambda: len(cloud_server.server.table) == 0)


def test_reset_starts_a_new_session(client):
    chat = ChatSession(client)
    one = chat.say("hello there", 20)
    chat.reset()
    again = chat.say("hello there", 20)
    assert again.prefilled_tokens == again.prompt_tokens == one.prompt_tokens
    assert again.token_ids == one.token_ids
    chat.close()


def test_the_repl_streams_and_answers_commands(client):
    lines = iter(["/stats", "hello there", "", "more", "/stats", "/bogus", "/reset", "/exit", "never read"])
    out: list[str] = []
    code = run_chat(ChatSession(client), 12, None, read=lambda _prompt: next(lines), write=out.append)
    text = "".join(out)
    assert code == 0 and next(lines) == "never read"
    assert "no turn yet." in text and "unknown command /bogus" in text and "(new conversation)" in text
    summaries = [line for line in text.splitlines() if line.startswith("[") and "tok/s" in line]
    assert len(summaries) == 2 and "accepted/step" in summaries[0] and "round trip" in summaries[0]
    assert "reused from the cache" in text


def test_shipped_model_chat_template_reuses_the_cache(smollm2_shards):
    """SmolLM2's real template (it injects a default system prompt): turn 2 prefills only its own tokens."""
    client = open_client(local_only=True, shards=smollm2_shards)
    chat = ChatSession(client)
    first = chat.say("What is the capital of France?", 24)
    second = chat.say("And of Italy?", 24)
    assert second.prefilled_tokens < 20 < second.prompt_tokens - second.prefilled_tokens
    conversation = chat.conversation.history[: second.prompt_tokens]
    assert conversation[: first.prompt_tokens] == chat.tokenizer.apply_chat_template(
        chat.messages[:1], add_generation_prompt=True)["input_ids"]
    fresh = client.generate(conversation, max_new_tokens=24, chat=False)
    assert second.token_ids == fresh.token_ids and second.text == fresh.text
    chat.close()
