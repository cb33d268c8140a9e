"""The official `openai` client against the api server, backed by a tiny model split over a real cloud server."""

from __future__ import annotations

import http.client
import json
import threading
import urllib.error
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitinfer.api.engine import Engine
from splitinfer.api.server import ApiServer
from splitinfer.launch import free_port
from splitinfer.local.client import SplitClient
from splitinfer.local.session import ClientConfig
from splitinfer.metrics import LocalMetrics

F32 = ClientConfig(wire_dtype="float32", retry_backoff_s=0.05)
MODEL = "tiny-chat"
HELLO = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def split_client(chat_shards, cloud_server):
    return SplitClient.connect(chat_shards / "local", cloud_server.url, F32, allow_public_weights=True)


@pytest.fixture
def api(split_client):
    """A fresh api server (and metrics registry) per test; yields (openai client, engine, server)."""
    engine = Engine(split_client, MODEL, LocalMetrics(), max_concurrent=4)
    with ApiServer(engine, port=0) as server:
        yield openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120), engine, server


def reference(client: SplitClient, prompt_ids: list[int], n: int):
    return client.generate(prompt_ids, max_new_tokens=n, chat=False, strategy="sequential")


def test_chat_and_completion_match_the_client_and_count_usage(api, split_client):
    oc, engine, _ = api
    ids = engine.chat_ids(HELLO)
    ref = reference(split_client, ids, 24)
    r = oc.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(ref.token_ids))
    assert r.usage.total_tokens == len(ids) + len(ref.token_ids)

    ids = engine.prompt_ids("the cat sat")
    ref = reference(split_client, ids, 24)
    c = oc.completions.create(model=MODEL, prompt="the cat sat", max_tokens=24, temperature=0)
    assert c.choices[0].text == ref.text and c.usage.prompt_tokens == len(ids)
    assert oc.models.list().data[0].id == MODEL


def test_streaming_gives_the_same_text_and_usage(api):
    oc, _, _ = api
    full = oc.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=30, temperature=0)
    chunks = list(oc.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=30, temperature=0, stream=True,
                                             stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # really streamed
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens

    plain = oc.completions.create(model=MODEL, prompt="abc", max_tokens=20, temperature=0)
    streamed = "".join(c.choices[0].text for c in oc.completions.create(
        model=MODEL, prompt="abc", max_tokens=20, temperature=0, stream=True) if c.choices)
    assert streamed == plain.choices[0].text


def test_stop_strings_cut_the_text_streamed_or_not(api):
    oc, _, _ = api
    full = oc.completions.create(model=MODEL, prompt="the cat sat", max_tokens=40, temperature=0).choices[0].text
    assert len(full) >= 12, full
    stop = full[8:10]
    expected = full[: full.index(stop)]
    cut = oc.completions.create(model=MODEL, prompt="the cat sat", max_tokens=40, temperature=0, stop=[stop, "\x7d\x7d\x7d"])
    assert cut.choices[0].text == expected and cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < 40
    streamed = "".join(c.choices[0].text for c in oc.completions.create(
        model=MODEL, prompt="the cat sat", max_tokens=40, temperature=0, stop=stop, stream=True) if c.choices)
    assert streamed == expected


def test_seed_reproduces_a_sampled_completion(api):
    oc, _, _ = api

    def sample(seed):
        return oc.completions.create(model=MODEL, prompt="abc", max_tokens=40, temperature=2.0, seed=seed).choices[0].text

    first = sample(7)
    assert sample(7) == first
    assert any(sample(s) != first for s in (8, 9, 10))


def test_concurrent_requests_equal_serial_ones(api):
    oc, engine, _ = api
    prompts = ["the cat sat", "hello", "abc def", "xyz!", "0123", "quick brown"]

    def ask(p):
        return oc.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0).choices[0].text

    serial = [ask(p) for p in prompts]
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def worker(i):
        try:
            results[i] = ask(prompts[i])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert [results[i] for i in range(len(prompts))] == serial


def _raw(server, method, path, body: bytes | None = None):
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", data=body, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_bad_requests_get_openai_error_bodies(api):
    oc, _, server = api
    with pytest.raises(openai.NotFoundError) as e:
        oc.chat.completions.create(model="gpt-4o", messages=HELLO)
    assert e.value.body["code"] == "model_not_found" and "tiny-chat" in e.value.body["message"]
    for kwargs, param in (({"n": 2}, "n"), ({"temperature": 5}, "temperature"), ({"max_tokens": 0}, "max_tokens"),
                          ({"stop": ["a"] * 5}, "stop")):
        with pytest.raises(openai.BadRequestError) as e:
            oc.chat.completions.create(model=MODEL, messages=HELLO, **kwargs)
        assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        oc.completions.create(model=MODEL, prompt="abc", max_tokens=50_000)
    assert e.value.body["code"] == "context_length_exceeded"
    status, body = _raw(server, "POST", "/v1/chat/completions", b"{not json")
    assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
    status, body = _raw(server, "POST", "/v1/chat/completions", json.dumps({"model": MODEL, "messages": []}).encode())
    assert status == 400 and body["error"]["param"] == "messages"
    status, body = _raw(server, "GET", "/v1/nothing")
    assert status == 404 and body["error"]["code"] == "not_found"
    # An error reply consumes the request body, so the kept-alive connection serves the next request.
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/nothing", body=b'{"x": 1}', headers={"Content-Type": "application/json"})
    first = conn.getresponse()
    assert first.status == 404 and json.loads(first.read())["error"]["code"] == "not_found"
    conn.request("POST", "/v1/completions", body=json.dumps({"model": MODEL, "prompt": "ab", "max_tokens": 3}).encode())
    second = conn.getresponse()
    assert second.status == 200 and json.loads(second.read())["usage"]["completion_tokens"] <= 3
    conn.close()


def test_an_unreachable_cloud_is_a_503_in_openai_format(chat_shards):
    client = SplitClient.connect(chat_shards / "local", f"ws://127.0.0.1:{free_port()}",
                                 ClientConfig(wire_dtype="float32", max_retries=0), allow_public_weights=True)
    with ApiServer(Engine(client, MODEL, LocalMetrics()), port=0) as server:
        oc = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:
            oc.completions.create(model=MODEL, prompt="abc", max_tokens=4, temperature=0)
    assert e.value.status_code == 503 and e.value.body["code"] == "transport"
    assert "splitinfer serve" in e.value.body["message"]


def _families(server) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=30) as resp:
        return {f.name: f for f in text_string_to_metric_families(resp.read().decode())}


def _value(families, name, suffix="", **labels):
    return sum(s.value for s in families[name].samples
               if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items()))


def test_metrics_exposition_parses_back_to_what_was_served(api):
    oc, _, server = api
    rs = [oc.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0, extra_body={"strategy": "tree"})
          for p in ("the cat sat", "hello")]
    with pytest.raises(openai.NotFoundError):
        oc.completions.create(model="other", prompt="x")
    f = _families(server)
    steps = sum(r.model_extra["splitinfer"]["steps"] for r in rs)
    assert _value(f, "splitinfer_round_trip_seconds", "_count") == steps
    assert _value(f, "splitinfer_fixed_overhead_seconds", "_count") == steps
    assert _value(f, "splitinfer_accepted_tokens_per_step", "_count") == steps
    assert _value(f, "splitinfer_accepted_tokens_per_step", "_sum") >= sum(r.usage.completion_tokens - 1 for r in rs)
    assert _value(f, "splitinfer_round_trip_seconds", "_sum") > 0
    assert _value(f, "splitinfer_tokens", "_total", kind="generated") == sum(r.usage.completion_tokens for r in rs)
    assert _value(f, "splitinfer_tokens", "_total", kind="prompt") == sum(r.usage.prompt_tokens for r in rs)
    assert _value(f, "splitinfer_bytes", "_total", direction="up") > 0
    assert _value(f, "splitinfer_errors", "_total", code="model_not_found") == 1
    assert _value(f, "splitinfer_active_sessions") == 0  # every request closed its session
    assert _value(f, "splitinfer_kv_cache_tokens") == 0
    assert _value(f, "splitinfer_tokens_per_second", "_count") == 2


def test_api_keys_are_required_when_configured(split_client):
    with ApiServer(Engine(split_client, MODEL, LocalMetrics()), port=0, api_keys=("k1", "k2")) as server:
        with pytest.raises(openai.AuthenticationError) as e:
            openai.OpenAI(base_url=server.url, api_key="wrong", max_retries=0).models.list()
        assert e.value.body["code"] == "invalid_api_key"
        assert openai.OpenAI(base_url=server.url, api_key="k2", max_retries=0).models.list().data[0].id == MODEL
        status, body = _raw(server, "GET", "/health")
        assert status == 200


def test_a_client_leaving_mid_stream_frees_its_cloud_session(api, cloud_server, settle):
    _, engine, server = api
    body = json.dumps({"model": MODEL, "prompt": "abc", "max_tokens": 15000, "temperature": 0, "stream": True})
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", body=body.encode(), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    assert settle(lambda: len(cloud_server.server.table) == 1)
    conn.sock.shutdown(2)
    conn.close()
    # 15000 tokens take tens of seconds: a session gone within 5 s was closed because the client left.
    assert settle(lambda: len(cloud_server.server.table) == 0, timeout_s=5)
    assert settle(lambda: b"splitinfer_active_sessions 0.0" in engine.metrics.render())
