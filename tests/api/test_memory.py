"""The api engine and the terminal chat keep one memory of earlier replies per process, bounded, and
drafting from it leaves greedy replies unchanged."""

from __future__ import annotations

from splitinfer.api.chat import ChatSession
from splitinfer.api.engine import Engine
from splitinfer.api.protocol import Params
from splitinfer.clients import open_client


def _params(max_tokens: int) -> Params:
    return Params(max_tokens=max_tokens, temperature=0.0, top_p=1.0, top_k=0, seed=None, stop=(), stream=False,
                  include_usage=False, strategy="tree")


def test_engine_requests_share_a_bounded_memory_and_replies_stay_exact(chat_shards):
    client = open_client(local_only=True, shards=chat_shards)
    ids = client.encode_prompt("tell me about the sea")
    expected = client.generate(ids, max_new_tokens=16, strategy="sequential").token_ids
    engine = Engine(client, "tiny", memory_tokens=40)
    first = engine.generate(ids, _params(16))
    second = engine.generate(ids, _params(16))
    assert first.token_ids == second.token_ids == expected
    assert engine.memory.index.docs == [expected, expected]  # 2 x at most 16 tokens fit in 40
    engine.generate(ids, _params(16))
    assert engine.memory.tokens <= 40 and engine.memory.index.docs[-1] == expected
    assert Engine(client, "tiny", memory_tokens=0).memory is None


def test_chat_memory_survives_reset(chat_shards):
    client = open_client(local_only=True, shards=chat_shards)
    with ChatSession(client, memory_tokens=1000) as chat:
        turn = chat.say("hello", 8)
        chat.reset()
        assert chat.conversation.memory.index.docs == [turn.token_ids]
