"""The cloud server over real WebSockets on loopback: limits, errors, recovery, isolation, long prompts."""

from __future__ import annotations

import threading

import pytest
import torch
from websockets.sync.client import connect

from splitinfer.cloud.server import ServerConfig, ServerThread
from splitinfer.cloud.sessions import SessionConfig
from splitinfer.decoding.loop import decode
from splitinfer.decoding.strategies import Sequential
from splitinfer.errors import CapacityError, ShardMismatch
from splitinfer.clients import open_client
from splitinfer.launch import free_port
from splitinfer.local.middle import RemoteMiddle
from splitinfer.local.session import ClientConfig, SplitSession
from splitinfer.model.shards import load_cloud, load_local
from splitinfer.wire.frame import decode_frame
from splitinfer.masks import BlockStructure
from splitinfer.wire.messages import Hello, Limits, Result, Step, Welcome, decode_server_message

from clock import FakeClock, expire_all
from tiny import prepare_tiny

PROMPT = [3, 17, 42, 5, 88, 21, 9, 60, 33, 7, 14, 2, 71]
F32 = ClientConfig(wire_dtype="float32", prefill_chunk=8, retry_backoff_s=0.05)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model, shards = prepare_tiny(tmp_path_factory.mktemp("server"), "llama", 2, 2)
    expected = model.generate(torch.tensor([PROMPT]), max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    return shards, expected[0, len(PROMPT) :].tolist()


def run_with_hook(local, middle, n, hook, config=F32):
    """Sequential decoding with `hook(i, session)` called after the i-th token."""
    session = SplitSession(local, middle, config)
    tokens: list[int] = []

    def emit(token, _logprob):
        tokens.append(token)
        hook(len(tokens), session)

    decode(session, PROMPT, session.prefill(PROMPT), n, set(), emit, Sequential())
    session.close()
    return tokens, session


def remote(local, url, dtype="float32"):
    split = local.manifest["split"]
    return RemoteMiddle(url, local.fingerprint, tuple(split["cloud_layers"]), local.config.hidden_size, dtype)


def test_ttl_expiry_is_recovered_with_identical_output(tiny, settle):
    shards, expected = tiny
    local = load_local(shards / "local")
    clock = FakeClock()
    with ServerThread(load_cloud(shards / "cloud"), ServerConfig(port=0, sessions=SessionConfig(ttl_s=10))) as server:
        table = server.server.table
        table.clock = clock  # set before any session opens; the server's sweep reads it too

        def idle(i, session):
            if i == 6:
                clock.advance(11)  # longer than the TTL: the server drops the session
                assert settle(lambda: expire_all(table))

        tokens, session = run_with_hook(local, remote(local, server.url), 20, idle)
    assert tokens == expected
    assert sum(r.recoveries for r in session.records) == 1


def test_server_restart_is_recovered_with_identical_output(tiny):
    shards, expected = tiny
    local, cloud = load_local(shards / "local"), load_cloud(shards / "cloud")
    port = free_port()
    servers = [ServerThread(cloud, ServerConfig(port=port))]

    def restart(i, session):
        if i == 8:
            servers[0].close()
            servers.append(ServerThread(cloud, ServerConfig(port=port)))

    try:
        tokens, session = run_with_hook(local, remote(local, f"ws://127.0.0.1:{port}"), 20, restart)
    finally:
        servers[-1].close()
    assert tokens == expected
    assert sum(r.recoveries for r in session.records) >= 1


def test_dropped_connection_resumes_the_same_session(tiny, settle):
    shards, expected = tiny
    local = load_local(shards / "local")
    with ServerThread(load_cloud(shards / "cloud")) as server:

        def drop(i, session):
            if i in (4, 11):
                session.middle._ws.close()

        tokens, session = run_with_hook(local, remote(local, server.url), 20, drop)
        assert settle(lambda: len(server.server.table) == 0)  # closed at the end, nothing left behind
    assert tokens == expected
    assert sum(r.recoveries for r in session.records) == 2
    # A resumed session needs no re-prefill: no step after prefill sent more than one row.
    assert all(r.rows == 1 for r in session.records if r.kind == "decode")


def test_shard_mismatch_is_refused(tiny, tmp_path):
    shards, _ = tiny
    _, other = prepare_tiny(tmp_path, "llama", 2, 2, seed=1)  # same shapes, other weights
    with ServerThread(load_cloud(other / "cloud")) as server:
        client = open_client(shards / "local", server.url, F32, allow_public_weights=True, checks=False)
        with pytest.raises(ShardMismatch, match="prepared together"):
            client.generate(PROMPT, max_new_tokens=2, stop_ids=set())


def test_session_limit_answers_retry_later(tiny):
    shards, _ = tiny
    local = load_local(shards / "local")
    config = ServerConfig(port=0, sessions=SessionConfig(max_sessions=1))
    with ServerThread(load_cloud(shards / "cloud"), config) as server:
        holder = remote(local, server.url)
        holder.open()
        with pytest.raises(CapacityError, match="retry later"):
            remote(local, server.url).open()
        holder.close()
        assert remote(local, server.url).open().resumed is False


def test_token_budget_answers_retry_later(tiny):
    shards, _ = tiny
    config = ServerConfig(port=0, sessions=SessionConfig(max_cached_tokens=10))
    with ServerThread(load_cloud(shards / "cloud"), config) as server:
        client = open_client(shards / "local", server.url, F32, allow_public_weights=True, checks=False)
        with pytest.raises(CapacityError, match="KV budget"):
            client.generate(PROMPT, max_new_tokens=2, stop_ids=set())


def test_concurrent_sessions_and_a_hostile_peer(tiny, settle):
    """Four clients generate at once while a fifth connection sends garbage; every output is exact."""
    shards, expected = tiny
    with ServerThread(load_cloud(shards / "cloud")) as server:
        results: dict[int, list[int]] = {}
        errors: list[BaseException] = []

        def worker(i):
            try:
                client = open_client(shards / "local", server.url, F32, allow_public_weights=True, checks=False)
                results[i] = client.generate(PROMPT, max_new_tokens=20, stop_ids=set()).token_ids
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        limits = Limits(hidden_size=64)
        with connect(server.url, compression=None) as ws:
            for junk in (b"", b"\x00\x00\x00\x05{}", b"\x00\x00\x00\x02[]", b"\xff" * 64, "text"):
                ws.send(junk)
                reply = decode_server_message(ws.recv(timeout=10), limits)
                assert reply.code == "protocol", reply
            ws.send(b"\x00\x00\x00\x0e{\"type\":\"step\"}")
            header, _ = decode_frame(ws.recv(timeout=10))
            assert header["type"] == "error"
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors
        assert all(results[i] == expected for i in range(4))
        assert settle(lambda: len(server.server.table) == 0)


def test_step_before_hello_and_version_mismatch(tiny):
    shards, _ = tiny
    local = load_local(shards / "local")
    with ServerThread(load_cloud(shards / "cloud")) as server:
        limits = Limits(hidden_size=64)
        step = Step(0, (), (0,), BlockStructure.chain(), torch.randn(1, 64), "float32").encode()
        with connect(server.url, compression=None) as ws:
            split = local.manifest["split"]
            ws.send(step)
            reply = decode_server_message(ws.recv(timeout=10), limits)
            assert (reply.code, reply.seq, reply.message) == ("protocol", 0, "send hello before the first step.")
            ws.send(Hello(local.fingerprint, tuple(split["cloud_layers"]), "float32", version=99).encode())
            reply = decode_server_message(ws.recv(timeout=10), limits)
            assert reply.code == "version" and "upgrade" in reply.message
            ws.send(step)  # a refused hello opened nothing
            assert "send hello" in decode_server_message(ws.recv(timeout=10), limits).message
            ws.send(Hello(local.fingerprint, tuple(split["cloud_layers"]), "float32").encode())
            assert isinstance(decode_server_message(ws.recv(timeout=10), limits), Welcome)
            ws.send(step)
            assert isinstance(decode_server_message(ws.recv(timeout=10), limits), Result)


@pytest.mark.slow  # a 16k-token prompt on both paths: ~20 s quiet
def test_long_prompt_is_chunked_under_the_default_message_limit(tiny):
    """A 16k-token prompt goes through the default 16 MiB limit in chunks, with the local-only result."""
    shards, _ = tiny
    torch.manual_seed(0)
    prompt = torch.randint(0, 96, (16_384,)).tolist()
    reference = open_client(local_only=True, shards=shards).generate(prompt, max_new_tokens=4, stop_ids=set())
    with ServerThread(load_cloud(shards / "cloud")) as server:
        client = open_client(shards / "local", server.url, ClientConfig(wire_dtype="float32"), allow_public_weights=True, checks=False)
        got = client.generate(prompt, max_new_tokens=4, stop_ids=set())
    assert got.token_ids == reference.token_ids
    assert got.stats["prefill_messages"] == 32


def test_graphed_steps_serve_the_local_only_tokens(tiny):
    """`serve --graphs static`: the graphs' static pass on this CPU, through the server, sequential and tree."""
    from splitinfer.model.graphs import use_graphs

    shards, expected = tiny
    cloud = load_cloud(shards / "cloud")
    use_graphs(cloud.stack, "static")
    with ServerThread(cloud) as server:
        client = open_client(shards / "local", server.url, F32, allow_public_weights=True, checks=False)
        for strategy in ("sequential", "tree-nohead"):
            got = client.generate(PROMPT, max_new_tokens=20, stop_ids=set(), strategy=strategy)
            assert got.token_ids == expected, strategy
    assert cloud.stack.graphs.stats()["replayed"] > 20


def test_graph_modes_on_a_cpu(tiny):
    from splitinfer.model.graphs import use_graphs
    from splitinfer.errors import ConfigError

    shards, _ = tiny
    stack = load_cloud(shards / "cloud").stack
    use_graphs(stack, "auto")
    use_graphs(stack, "off")
    assert stack.graphs is None  # auto: graphs only on a CUDA device
    with pytest.raises(ConfigError, match="one CUDA device"):
        use_graphs(stack, "on")
