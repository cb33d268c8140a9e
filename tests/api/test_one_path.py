"""One generation path: generate is a one-turn conversation; text, stop strings and cancellation live once."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import splitinfer
from splitinfer.api.chat import ChatSession
from splitinfer.api.engine import Engine
from splitinfer.api.protocol import Params
from splitinfer.local.client import SplitClient
from splitinfer.local.session import ClientConfig
from splitinfer.errors import ConfigError
from splitinfer.local.text import TextStream, chat_prompt_ids, has_chat_template
from splitinfer.metrics import LocalMetrics
from tiny import char_tokenizer

F32 = ClientConfig(wire_dtype="float32", retry_backoff_s=0.05)


@pytest.fixture
def client(chat_shards, cloud_server):
    return SplitClient.connect(chat_shards / "local", cloud_server.url, F32, allow_public_weights=True)


def test_generate_equals_a_one_turn_conversation(client, cloud_server, settle):
    ids = chat_prompt_ids(client.local.tokenizer, [{"role": "user", "content": "hello there"}])
    streamed: list[str] = []
    gen = client.generate("hello there", max_new_tokens=30, strategy="sequential", on_text=streamed.append)
    assert gen.prompt_token_ids == ids and "".join(streamed) == gen.text
    metrics = LocalMetrics()
    with client.conversation("sequential", metrics) as conversation:
        turn = conversation.send(ids, 30)
        assert len(cloud_server.server.table) == 1
    assert settle(lambda: len(cloud_server.server.table) == 0)  # leaving the `with` ended the cloud session
    assert (turn.token_ids, turn.text, turn.finish_reason) == (gen.token_ids, gen.text, gen.finish_reason)
    assert turn.logprobs == pytest.approx(gen.logprobs, abs=1e-5)
    assert set(turn.stats) == set(gen.stats) and len(turn.steps) == len(gen.steps)
    assert turn.stats["mode"] == "split" and turn.stats["head_layers"] == gen.stats["head_layers"]
    steps = [s for s in turn.steps if s["kind"] == "decode"]
    assert [s["accepted"] for s in steps] == [1] * (len(turn.token_ids) - 1)  # the verifier counted the accepted rows
    rendered = metrics.render().decode()
    assert f'splitinfer_tokens_total{{kind="generated"}} {float(len(turn.token_ids))}' in rendered
    assert f"splitinfer_accepted_tokens_per_step_count {float(len(steps))}" in rendered


def test_engine_stop_strings_match_a_cut_generation(client):
    full = client.generate("hello there", max_new_tokens=30)
    assert len(full.text) > 4
    stop = full.text[2:4]
    engine = Engine(client, "tiny-chat")
    ids = engine.chat_ids([{"role": "user", "content": "hello there"}])
    turn = engine.generate(ids, Params(30, 0.0, 1.0, 0, None, (stop,), False, False, "tree"))
    assert turn.finish_reason == "stop" and turn.text == full.text[: full.text.find(stop)]
    assert turn.token_ids == full.token_ids[: len(turn.token_ids)]


def test_a_failing_reader_ends_the_generation_and_its_cloud_session_at_once(client, cloud_server, settle):
    class Gone(Exception):
        pass

    def reader(_text):
        raise Gone

    conversation = client.conversation("sequential")
    with pytest.raises(Gone):
        conversation.send(client.local.tokenizer("abc")["input_ids"], 15000, on_text=reader)
    assert conversation.session is None and conversation.history == []
    assert settle(lambda: len(cloud_server.server.table) == 0, timeout_s=5)
    with conversation:  # still usable: the next turn opens a new session and starts from scratch
        again = conversation.send(client.local.tokenizer("abc")["input_ids"], 5)
    assert again.prefilled_tokens == again.prompt_tokens == 3


def test_a_chat_is_a_context_manager(client, cloud_server, settle):
    with ChatSession(client) as chat:
        chat.say("hi", 4)
        assert len(cloud_server.server.table) == 1
    assert settle(lambda: len(cloud_server.server.table) == 0)


def test_text_stream_streams_final_pieces_and_cuts_at_stop_strings(client):
    tok = client.local.tokenizer  # one character per token
    ids = tok("hello world, bye")["input_ids"]
    pieces: list[str] = []
    stream = TextStream(tok, pieces.append, stop_ids={0}, stop_strings=("ld,",))
    ended = [stream.push(t) for t in ids]
    assert ended.index(True) == len("hello world,") - 1  # the token completing the stop string ends it
    assert stream.finish() == "".join(pieces) == "hello wor"

    quiet = TextStream(tok, None, stop_ids={0})
    assert not any(quiet.push(t) for t in ids + [0])
    assert not quiet.sent and quiet.finish() == "hello world, bye"  # nothing decoded until the end, no <eos>


def template_reads(source: str, module: str) -> list[str]:
    """'module:line' for each read of a tokenizer's chat template: `.chat_template` or getattr(..., "chat_template")."""
    return [f"{module}:{node.lineno}" for node in ast.walk(ast.parse(source))
            if (isinstance(node, ast.Attribute) and node.attr == "chat_template")
            or (isinstance(node, ast.Constant) and node.value == "chat_template")]


def test_the_chat_template_is_checked_in_one_place():
    """The Python API's text prompts, the terminal chat and the HTTP API ask has_chat_template (local/text.py)."""
    package = Path(splitinfer.__file__).parent
    found = [hit for folder in ("local", "api") for path in sorted((package / folder).rglob("*.py"))
             for hit in template_reads(path.read_text(), path.relative_to(package).as_posix())]
    assert len(found) == 1 and found[0].startswith("local/text.py:"), found
    assert template_reads("a = tok.chat_template\nb = getattr(tok, 'chat_template', None)\n", "m") == ["m:1", "m:2"]


def test_without_a_chat_template_every_front_says_what_to_use_instead(client):
    plain = char_tokenizer()
    plain.chat_template = None
    assert has_chat_template(char_tokenizer()) and not has_chat_template(plain) and not has_chat_template(None)
    client.local.tokenizer = plain
    assert client.encode_prompt("hi") == plain("hi")["input_ids"]  # the prompt as it is
    with pytest.raises(ConfigError, match="--no-chat"):
        ChatSession(client)
    with pytest.raises(ConfigError, match="/v1/completions"):
        Engine(client, "tiny-chat").chat_ids([{"role": "user", "content": "hi"}])
