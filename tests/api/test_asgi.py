"""The ASGI api server under load and misbehaving clients: disconnects, slow readers, many streams, limits.

The cloud side is a real server; "the cloud session is gone" is read from its session table.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import openai
import pytest

from splitinfer.api.app import ApiLimits
from splitinfer.api.engine import Engine
from splitinfer.api.server import ApiServer
from splitinfer.launch import free_port
from splitinfer.local.client import SplitClient
from splitinfer.local.session import ClientConfig
from splitinfer.metrics import LocalMetrics

F32 = ClientConfig(wire_dtype="float32", retry_backoff_s=0.05)
MODEL = "tiny-chat"


@pytest.fixture(scope="module")
def split_client(chat_shards, cloud_server):
    return SplitClient.connect(chat_shards / "local", cloud_server.url, F32, allow_public_weights=True)


def serve(split_client, max_concurrent=4, **limits) -> ApiServer:
    return ApiServer(Engine(split_client, MODEL, LocalMetrics(), max_concurrent=max_concurrent), port=0,
                     limits=ApiLimits(**limits))


def open_stream(server, max_tokens: int, rcvbuf: int | None = None) -> socket.socket:
    """A raw streamed completion request; returns the socket with the request sent."""
    body = json.dumps({"model": MODEL, "prompt": "abc", "max_tokens": max_tokens, "temperature": 0, "stream": True})
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: it sets the TCP window
    sock.connect(("127.0.0.1", server.port))
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
    return sock


def sse_text(raw: bytes) -> tuple[str, list[dict]]:
    """The completion text and the JSON events of a chunked SSE response."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    body = b""
    while rest:  # undo the chunked transfer encoding
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        body, rest = body + rest[:n], rest[n + 2 :]
    events = [line[6:] for line in body.decode().split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"]), chunks


def test_a_stream_dropped_mid_way_frees_its_cloud_session_within_a_second(split_client, cloud_server, settle):
    table = cloud_server.server.table
    with serve(split_client) as server:
        for stream in (True, False):  # a non-streamed request is watched the same way
            body = json.dumps({"model": MODEL, "prompt": "abc", "max_tokens": 15000, "temperature": 0, "stream": stream})
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
            conn.request("POST", "/v1/completions", body=body.encode(), headers={"Content-Type": "application/json"})
            if stream:
                resp = conn.getresponse()
                assert resp.status == 200 and resp.readline().startswith(b"data: ")
            assert settle(lambda: len(table) == 1)
            left = time.monotonic()
            conn.sock.shutdown(socket.SHUT_RDWR)
            conn.close()
            # 15000 tokens take tens of seconds here: a session gone within 1 s was closed because the client left.
            assert settle(lambda: len(table) == 0, timeout_s=1.0), f"still {len(table)} session(s) after 1 s"
            print(f"stream={stream}: cloud session freed {1000 * (time.monotonic() - left):.0f} ms after the client left")
            assert settle(lambda: server.app.pending == 0, timeout_s=1.0)
        assert b"splitinfer_active_sessions 0.0" in server.app.engine.metrics.render()


def test_a_slow_reader_gets_the_whole_stream_without_holding_the_cloud(split_client, cloud_server, settle):
    table = cloud_server.server.table
    n = 2000
    server = serve(split_client)
    # Small socket buffers on both ends (accepted sockets inherit the listener's), so that the reply below
    # is many times what the kernel can hold and the server has to wait for the reader.
    server.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    with server:
        oc = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
        reference = oc.completions.create(model=MODEL, prompt="abc", max_tokens=n, temperature=0)
        sock = open_stream(server, n, rcvbuf=4096)
        first = sock.recv(256)
        assert first.startswith(b"HTTP/1.1 200")
        # The reader stops reading. Generation goes on regardless: the session closes while the reply sits unread.
        assert settle(lambda: len(table) == 0 and server.app.pending == 0, timeout_s=30)
        # the event loop is not blocked by the stalled stream: a request still gets its answer (in 5 s, else it raises)
        assert oc.with_options(timeout=5.0).models.list().data[0].id == MODEL
        raw = first
        while not raw.endswith(b"0\r\n\r\n"):  # read slowly, a few KB at a time
            data = sock.recv(4096)
            assert data, "the server closed the stream early"
            raw += data
            time.sleep(0.001)
        sock.close()
    text, chunks = sse_text(raw)
    assert len(raw) > 200_000  # far more than the socket buffers hold: the server really waited for the reader
    assert text == reference.choices[0].text
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == reference.choices[0].finish_reason


def test_sixteen_concurrent_streams_all_complete_with_the_right_text(split_client):
    prompts = [f"prompt {i}: " + "abcdefgh"[: 1 + i % 8] for i in range(16)]
    with serve(split_client, max_concurrent=4) as server:  # 4 generate at once, 12 wait for a slot
        oc = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=300)
        serial = {}
        for i, prompt in enumerate(prompts):
            if i % 2:
                r = oc.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                               max_tokens=40, temperature=0)
                serial[i] = (r.choices[0].message.content, r.choices[0].finish_reason)
            else:
                r = oc.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
                serial[i] = (r.choices[0].text, r.choices[0].finish_reason)
        results: dict[int, tuple[str, str]] = {}
        errors: list[BaseException] = []
        start = threading.Barrier(16)

        def worker(i):
            try:
                start.wait()
                if i % 2:
                    chunks = list(oc.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": prompts[i]}], max_tokens=40, temperature=0,
                        stream=True))
                    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                else:
                    chunks = list(oc.completions.create(model=MODEL, prompt=prompts[i], max_tokens=40, temperature=0,
                                                        stream=True))
                    text = "".join(c.choices[0].text for c in chunks if c.choices)
                finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
                results[i] = (text, finish[-1])
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not errors, errors
        assert results == serial
        assert server.app.pending == 0


def test_request_bodies_and_pending_requests_are_bounded(split_client, cloud_server, settle):
    with serve(split_client, max_concurrent=1, max_pending=1, max_body_bytes=1000) as server:
        oc = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.APIStatusError) as e:
            oc.completions.create(model=MODEL, prompt="x" * 2000, max_tokens=2)
        assert e.value.status_code == 413 and e.value.body["code"] == "too_large"
        # A chunked body has no length to refuse up front; it is cut off when it passes the bound.
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        conn.request("POST", "/v1/completions", body=iter([b"{", b" " * 1500, b"}"]), encode_chunked=True,
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 413 and json.loads(resp.read())["error"]["code"] == "too_large"
        conn.close()

        busy = open_stream(server, 15000)
        assert busy.recv(256).startswith(b"HTTP/1.1 200")
        with pytest.raises(openai.RateLimitError) as e:
            oc.completions.create(model=MODEL, prompt="abc", max_tokens=2)
        assert e.value.body["code"] == "rate_limit_exceeded" and e.value.response.headers["retry-after"] == "1"
        busy.close()
        assert settle(lambda: server.app.pending == 0, timeout_s=2)
        assert oc.completions.create(model=MODEL, prompt="abc", max_tokens=2).usage.completion_tokens <= 2

        # Shutting down ends a running stream with an error event and frees its cloud session.
        running = open_stream(server, 15000)
        assert settle(lambda: len(cloud_server.server.table) == 1)
    raw = b""
    while data := running.recv(65536):
        raw += data
    running.close()
    assert b'"code": "shutdown"' in raw and raw.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    assert settle(lambda: len(cloud_server.server.table) == 0, timeout_s=2)
    metrics = server.app.engine.metrics.render().decode()
    assert 'splitinfer_errors_total{code="too_large"} 2.0' in metrics
    assert 'splitinfer_errors_total{code="rate_limit_exceeded"} 1.0' in metrics


@pytest.mark.slow  # the api command as a process
def test_the_api_command_serves_and_ends_open_streams_on_ctrl_c(chat_shards, cloud_server, settle):
    port = free_port()
    cmd = [sys.executable, "-m", "splitinfer", "api", "--shard", str(chat_shards / "local"), "--server",
           cloud_server.url, "--port", str(port), "--allow-public-weights", "--model-name", MODEL]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert f"on http://127.0.0.1:{port}/v1" in proc.stdout.readline()
        server = type("Server", (), {"port": port})
        sock = open_stream(server, 15000)
        assert sock.recv(256).startswith(b"HTTP/1.1 200")
        assert settle(lambda: len(cloud_server.server.table) == 1)
        proc.send_signal(signal.SIGINT)
        raw = b""
        while data := sock.recv(65536):
            raw += data
        sock.close()
        assert proc.wait(timeout=30) in (0, 130)
    finally:
        proc.kill()
    # Without the shutdown event uvicorn would cut the stream after its 5 s grace, with no event.
    assert b'"code": "shutdown"' in raw and raw.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    # The process waited for its generation to close the cloud session (else it would live on to the TTL).
    assert settle(lambda: len(cloud_server.server.table) == 0, timeout_s=2)
    assert "Traceback" not in proc.stderr.read()


def test_a_failure_after_the_headers_travels_as_an_error_event(split_client):
    with serve(split_client) as server:
        oc = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.APIError) as e:  # the client raises on an error event inside the stream
            for _ in oc.completions.create(model=MODEL, prompt="abc", max_tokens=50_000, stream=True):
                pass
        assert "context" in e.value.message and e.value.body["code"] == "context_length_exceeded"
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50_000, "stream": True}
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        events = [line for line in resp.read().decode().split("\n\n") if line]
        conn.close()
        assert resp.status == 200 and events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["error"]["code"] == "context_length_exceeded"
        metrics = server.app.engine.metrics.render().decode()
        assert 'splitinfer_errors_total{code="context_length_exceeded"} 2.0' in metrics
