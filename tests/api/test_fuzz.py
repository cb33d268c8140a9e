"""The HTTP API fuzzed: OpenAI-shaped request bodies with wrong types, missing and extra fields, huge, negative
and non-finite numbers, odd Unicode and deep nesting, sent to the ASGI app in-process by clients that read
the whole reply, read it slowly, or go away before it or in the middle of it.

Every reply must be an OpenAI error body or a valid completion (streamed or not); 5xx only as the deliberate
capacity answer; no request may hang, and none may outlive its client. Greedy requests served between fuzz
cases must stay exactly what they were before the fuzzing. The cloud side is a real server
(tests/api/conftest.py), so a request that generates opens and closes a real cloud session.
`make test` runs 300 cases, the slow set (CI) a campaign of 2,000; SPLITINFER_API_FUZZ_EXAMPLES sets the count of
the first for a longer campaign (docs/security.md).
"""

from __future__ import annotations

import asyncio
import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitinfer.api.app import ApiApp
from splitinfer.api.engine import Engine
from splitinfer.local.client import SplitClient
from splitinfer.local.session import ClientConfig

MODEL = "tiny-chat"
EXAMPLES = int(os.environ.get("SPLITINFER_API_FUZZ_EXAMPLES", "300"))
CAMPAIGN = 2000  # the slow set's count
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
REPLY_TIMEOUT_S = 30.0  # a reply that takes longer is a hang
LEGIT_EVERY = 50  # fuzz cases between two legitimate requests


# -- an in-process HTTP client over ASGI -------------------------------------------------------------
async def call(app, path: str, body: bytes, gone_after: int | None = None, slow: bool = False,
               gone_after_s: float | None = None, silent: bool = False) -> tuple[int, bytes, bool]:
    """POST `body` to `path`: (status, response body, whether the client went away first). gone_after: the
    client disconnects after that many response messages (0: before any), or after `gone_after_s` seconds;
    slow: it reads slowly; silent: its going away shows only when the app sends (not as http.disconnect)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8000)}
    gone = asyncio.Event()
    if gone_after == 0:
        gone.set()
    delivered = False
    messages: list[dict] = []

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        if silent:
            await asyncio.Event().wait()  # never
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if gone.is_set():
            raise OSError("the client has gone away")  # what uvicorn does on a closed connection
        messages.append(message)
        if slow:
            await asyncio.sleep(0.002)
        if gone_after is not None and len(messages) >= gone_after:
            gone.set()

    if gone_after_s is not None:
        asyncio.get_running_loop().call_later(gone_after_s, gone.set)
    await asyncio.wait_for(app(scope, receive, send), REPLY_TIMEOUT_S)
    status = messages[0]["status"] if messages else 0
    return status, b"".join(m.get("body", b"") for m in messages[1:]), gone.is_set()


def check_reply(status: int, raw: bytes, cut: bool, chat: bool, stream: bool | None) -> None:
    """An OpenAI error body or a valid completion; a reply cut by its own client is checked as far as it went."""
    if status == 0:
        assert cut, "the app answered nothing to a client that stayed"
        return
    if status != 200:
        assert 400 <= status < 500 or (status == 503 and b'"capacity"' in raw), (status, raw[:300])
        if cut and not raw:
            return
        error = json.loads(raw)["error"]
        assert isinstance(error["message"], str) and error["message"] and len(error["message"]) < 1000
        assert isinstance(error["type"], str) and "param" in error and "code" in error
        return
    if raw.startswith(b"data: "):
        _check_stream(raw, cut, chat)
    elif not cut:
        reply = json.loads(raw)
        assert reply["object"] == ("chat.completion" if chat else "text_completion")
        choice = reply["choices"][0]
        assert isinstance(choice["message"]["content"] if chat else choice["text"], str)
        assert choice["finish_reason"] in ("stop", "length")
        assert reply["usage"]["completion_tokens"] >= 0


def _check_stream(raw: bytes, cut: bool, chat: bool) -> None:
    events = [e[6:] for e in raw.decode().split("\n\n") if e.startswith("data: ")]
    assert cut or events[-1] == "[DONE]", events[-3:]
    for event in events:
        if event == "[DONE]":
            continue
        chunk = json.loads(event)
        if "error" in chunk:
            assert isinstance(chunk["error"]["message"], str)
            continue
        assert chunk["object"] == ("chat.completion.chunk" if chat else "text_completion")
        for choice in chunk["choices"]:
            assert isinstance(choice["delta"] if chat else choice["text"], (dict, str))


# -- request bodies ----------------------------------------------------------------------------------
SURROGATES = st.sampled_from(["\ud800", "a\udfffb", "\udbff\udc00", "\ud83d"])  # the third is a valid pair
TEXT = st.one_of(st.text(max_size=12), st.text(st.characters(codec="utf-8"), max_size=6), SURROGATES,
                 st.sampled_from(["", "\x00", "\u200b\u202e", "\U0010ffff", "<|im_end|>", "\r\n" * 3, "é" * 40]))
LEAF = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-2**80, 2**80),
                 st.floats(allow_nan=True, allow_infinity=True), TEXT)
JSON = st.recursive(LEAF, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
                    max_leaves=10)
NOT_INT = JSON.filter(lambda v: not isinstance(v, int) or isinstance(v, bool))
ODD_NUMBERS = st.sampled_from([0, -1, -2**63, 2**31, 2**64, 10**30, 10**400, 20_001, 1e-300, 1e-5, 2.0001, 1.5,
                               float("nan"), float("inf"), -float("inf"), "3", True, None])


ROLES = st.sampled_from(["system", "developer", "user", "assistant", "tool", "", "User", "function"])
PART = st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
                 st.fixed_dictionaries({"type": st.just("image_url"), "image_url": JSON}), JSON)
CONTENT = st.one_of(TEXT, TEXT, st.lists(PART, max_size=3), JSON)
MESSAGE = st.one_of(st.fixed_dictionaries({"role": ROLES, "content": CONTENT}, optional={"name": JSON, "extra": JSON}),
                    JSON)
MESSAGES = st.one_of(st.lists(MESSAGE, min_size=1, max_size=4), st.just([]), JSON)
TOKEN_IDS = st.lists(st.one_of(st.integers(0, 95), st.integers(0, 95), st.integers(-5, 200)), min_size=0, max_size=8)
PROMPT = st.one_of(TEXT, TOKEN_IDS, st.lists(TOKEN_IDS, max_size=2), st.lists(TEXT, max_size=2), JSON)

GOOD = {  # values a legitimate client sends
    "model": st.just(MODEL),
    "max_tokens": st.integers(1, 6),
    "max_completion_tokens": st.integers(1, 6),
    "temperature": st.sampled_from([0, 0.0, 0.7, 1, 2]),
    "top_p": st.floats(0, 1),
    "top_k": st.integers(0, 200),
    "seed": st.integers(-2**63, 2**64 - 1),
    "n": st.just(1),
    "stop": st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=4)),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "strategy": st.sampled_from(["sequential", "tree", "jacobi", "lookahead", "tree-nohead"]),
    "logprobs": st.none() | st.booleans(),
    "user": st.text(max_size=8),
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                                "content": st.text(max_size=12)}), min_size=1, max_size=3),
    "prompt": st.one_of(st.text(min_size=1, max_size=12), st.lists(st.integers(0, 95), min_size=1, max_size=8)),
}
BAD = {  # what a careless or hostile one sends instead
    **{name: st.one_of(ODD_NUMBERS, JSON) for name in GOOD},
    "model": JSON,
    "max_tokens": st.one_of(ODD_NUMBERS, NOT_INT),  # not a valid count: a long generation is a test of its own
    "max_completion_tokens": st.one_of(ODD_NUMBERS, NOT_INT),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=6), JSON),
    "messages": MESSAGES,
    "prompt": PROMPT,
}


@st.composite
def request(draw) -> tuple[bool, bytes]:
    """(chat, body bytes): a legitimate body, one with one field wrong, missing or extra, a body of random
    fields, or not a JSON object at all."""
    chat = draw(st.booleans())
    names = ["model", "messages" if chat else "prompt"]
    optional = [n for n in GOOD if n not in ("model", "messages", "prompt")]
    present = names + draw(st.lists(st.sampled_from(optional), unique=True, max_size=6))
    body = {name: draw(GOOD[name]) for name in present}
    mode = draw(st.sampled_from(["good", "one wrong", "one wrong", "one missing", "random", "random"]))
    if mode == "one wrong":
        name = draw(st.sampled_from(sorted(GOOD)))
        body[name] = draw(BAD[name])
    elif mode == "one missing":
        del body[draw(st.sampled_from(present))]
    elif mode == "random":
        body = {name: draw(BAD[name]) for name in draw(st.lists(st.sampled_from(sorted(BAD)), unique=True))}
    body.update(draw(st.dictionaries(TEXT, JSON, max_size=2)))  # extra fields
    raw = json.dumps(body, allow_nan=True).encode()
    kind = draw(st.sampled_from(["json"] * 12 + ["bytes", "deep", "truncated", "array", "bigint"]))
    if kind == "bytes":
        raw = draw(st.binary(max_size=64))
    elif kind == "deep":
        depth = draw(st.sampled_from([50, 900, 5_000, 200_000]))
        raw = b'{"model": "tiny-chat", "prompt": "a", "user": ' + b"[" * depth + b"]" * depth + b"}"
    elif kind == "truncated":
        raw = raw[: draw(st.integers(0, max(0, len(raw) - 1)))]
    elif kind == "array":
        raw = b"[" + raw + b"]"
    elif kind == "bigint":
        raw = raw[:-1] + b', "max_tokens": ' + b"7" * draw(st.sampled_from([20, 4_000, 5_000])) + b"}"
    return chat, raw


CLIENTS = st.one_of(st.just((None, False)), st.just((None, False)), st.just((None, False)), st.just((None, True)),
                    st.tuples(st.integers(0, 4), st.booleans()))


# -- the campaign ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fuzz_app(chat_shards, cloud_server):
    client = SplitClient.connect(chat_shards / "local", cloud_server.url, ClientConfig(wire_dtype="float32"),
                                 allow_public_weights=True)
    app = ApiApp(Engine(client, MODEL, default_max_tokens=4, memory_tokens=0))
    loop = asyncio.new_event_loop()
    yield app, loop
    loop.close()


LEGIT = [
    (True, {"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 12,
            "temperature": 0}),
    (False, {"model": MODEL, "prompt": "The KV cache", "max_tokens": 12, "temperature": 0, "stream": True}),
]


def legit_texts(app, loop) -> list[bytes]:
    """The legitimate requests' texts (chunk ids and times stripped)."""
    texts = []
    for chat, body in LEGIT:
        status, raw, _ = loop.run_until_complete(call(app, _path(chat), json.dumps(body).encode()))
        assert status == 200, raw[:300]
        if raw.startswith(b"data: "):
            events = [json.loads(e[6:]) for e in raw.decode().split("\n\n") if e.startswith("data: {")]
            texts.append("".join(c["choices"][0]["text"] for c in events if c["choices"]).encode())
        else:
            texts.append(json.loads(raw)["choices"][0]["message"]["content"].encode())
    return texts


def _path(chat: bool) -> str:
    return "/v1/chat/completions" if chat else "/v1/completions"


@pytest.mark.parametrize("examples", [EXAMPLES, pytest.param(CAMPAIGN, marks=pytest.mark.slow)])
def test_fuzzed_requests_get_errors_or_completions_and_legit_requests_stay_exact(fuzz_app, cloud_server, settle,
                                                                                examples):
    app, loop = fuzz_app
    reference = legit_texts(app, loop)
    seen = {"cases": 0, "statuses": {}}

    @settings(FUZZ, max_examples=examples)
    @given(request(), CLIENTS)
    def case(req, client):
        chat, raw = req
        gone_after, slow = client
        status, reply, cut = loop.run_until_complete(call(app, _path(chat), raw, gone_after, slow))
        check_reply(status, reply, cut, chat, None)
        assert app.wait_idle(REPLY_TIMEOUT_S), "a generation outlived its request"
        seen["cases"] += 1
        seen["statuses"][status] = seen["statuses"].get(status, 0) + 1
        if seen["cases"] % LEGIT_EVERY == 0:
            assert legit_texts(app, loop) == reference

    case()
    assert legit_texts(app, loop) == reference
    assert settle(lambda: len(cloud_server.server.table) == 0), "a cloud session outlived its request"
    assert seen["cases"] >= examples // 2, seen  # hypothesis ran the campaign, not a few cases
    print(f"api fuzz: {seen['cases']} cases, statuses {dict(sorted(seen['statuses'].items()))}")


@settings(max_examples=12, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chat=st.booleans(), stream=st.booleans(), after=st.integers(0, 40), seconds=st.floats(0, 0.3))
def test_long_generations_abandoned_at_any_point_end_with_their_client(fuzz_app, cloud_server, settle, chat, stream,
                                                                        after, seconds):
    """A request for 15,000 tokens whose client leaves after `after` streamed messages, or after `seconds`
    when not streaming: the request returns at once, its generation stops and its cloud session closes."""
    app, loop = fuzz_app
    body = {"model": MODEL, "max_tokens": 15_000, "temperature": 0, "stream": stream,
            **({"messages": [{"role": "user", "content": "go on"}]} if chat else {"prompt": "go on"})}
    gone = dict(gone_after=after) if stream else dict(gone_after_s=seconds)
    status, raw, cut = loop.run_until_complete(call(app, _path(chat), json.dumps(body).encode(), **gone))
    assert cut
    check_reply(status, raw, cut, chat, stream)
    assert app.wait_idle(5), "the generation went on after its client left"
    assert settle(lambda: len(cloud_server.server.table) == 0)


FOUND = {  # what the first campaign found answered 500 (or with a misleading message), and what it gets now
    "an integer temperature too large for a float": (b'"temperature": 1' + b"0" * 400, "between 0 and 2; got an integer of about 401 digits"),
    "a temperature so small the logits overflow": (b'"temperature": 1e-300', "0 (greedy"),
    "top_p so small it rounds to 0 in float32": (b'"temperature": 1, "top_p": 1e-300', None),
    "a strategy that is not a string": (b'"strategy": [1]', "unknown strategy [1]"),
    "a text part whose text is not a string": (b'"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]',
                                               "with a string text"),
    "a lone surrogate in a message": (b'"messages": [{"role": "user", "content": "\\ud800"}]', "lone UTF-16 surrogate"),
    "a lone surrogate in a stop string": (b'"stop": ["\\udfff"]', "lone UTF-16 surrogate"),
    "nesting deeper than the parser recurses": (b'"user": ' + b"[" * 100_000 + b"]" * 100_000, "nests arrays or objects too deeply"),
    "an integer of 5000 digits": (b'"seed": ' + b"7" * 5000, "over 4300 digits"),
    "max_tokens of 4000 digits": (b'"max_tokens": ' + b"7" * 4000, "at most 2147483647; got an integer of about 4000 digits"),
    "a model name of 100 kB, quoted whole": (b'"model": "' + b"x" * 100_000 + b'"', "xxx... does not exist"),
}


@pytest.mark.parametrize("name", FOUND)
def test_what_the_fuzzer_found_is_answered_with_a_400_that_says_what_to_do(fuzz_app, name):
    app, loop = fuzz_app
    field, wanted = FOUND[name]
    raw = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0, "model": "tiny-chat", ' + field + b"}"
    status, reply, _ = loop.run_until_complete(call(app, _path(True), raw))
    check_reply(status, reply, False, True, False)
    if wanted is None:
        assert status == 200, reply[:300]
    else:
        assert status in (400, 404) and wanted in json.loads(reply)["error"]["message"], reply[:300]


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("stream", [True, False])
def test_a_client_gone_before_the_first_byte_is_no_error(fuzz_app, caplog, chat, stream):
    """Found by the fuzzer: a client that left before a stream's headers went out made the app raise the
    ASGI server's OSError (an error log per abandoned request); now the request just ends."""
    app, loop = fuzz_app
    body = {"model": MODEL, "max_tokens": 3, "temperature": 0, "stream": stream,
            **({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})}
    status, raw, cut = loop.run_until_complete(call(app, _path(chat), json.dumps(body).encode(), 0, silent=True))
    assert (status, raw, cut) == (0, b"", True)
    assert app.wait_idle(5)
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
