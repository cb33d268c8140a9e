"""`bench spec --turns 2`: a prompt's second turn runs in the same conversation, and every strategy's two turns
equal sequential decoding's, each turn also equal to a fresh one-turn generation from the same tokens."""

from __future__ import annotations

from splitinfer.bench.speculative import generations, turn_rows
from splitinfer.clients import open_client

PROMPT = {"id": "q1", "category": "writing", "prompt": "hello there", "turns": ["hello there", "and then?"]}


def test_second_turns_reuse_the_conversation_and_stay_exact(chat_shards):
    client = open_client(local_only=True, shards=chat_shards)
    rows = turn_rows(PROMPT, 2)
    assert [r["id"] for r in rows] == ["q1", "q1/2"] and rows[1]["prompt"] == "and then?"
    assert rows[1]["category"] == "writing, turn 2" and turn_rows(PROMPT, 1) == [PROMPT]
    assert turn_rows({"id": "x", "category": "c", "prompt": "p"}, 2) == [{"id": "x", "category": "c", "prompt": "p"}]
    sequential = generations(client, PROMPT, 12, "sequential", 2)
    first, second = sequential
    assert second.prompt_token_ids[: len(first.prompt_token_ids) + len(first.token_ids)] == (
        first.prompt_token_ids + first.token_ids)
    assert second.stats["cached_tokens"] > len(first.prompt_token_ids)  # turn one came from the caches
    for strategy in ("tree", "lookahead"):
        assert [g.token_ids for g in generations(client, PROMPT, 12, strategy, 2)] == [g.token_ids for g in sequential]
    fresh = client.generate(second.prompt_token_ids, max_new_tokens=12, strategy="sequential")
    assert fresh.token_ids == second.token_ids
