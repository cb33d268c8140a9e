"""Faults injected through the WAN emulator and by killing the server: the client reconnects with backoff,
recovers (resume or re-prefill) and its output is token for token that of an uninterrupted run.

Expiry by TTL and an in-process restart are covered in tests/cloud/test_server.py.
"""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack
from dataclasses import replace

import pytest

from splitinfer.cloud.security import load_server_tokens
from splitinfer.cloud.server import ServerConfig, ServerThread
from splitinfer.errors import TransportError
from splitinfer.launch import cloud_server, free_port
from splitinfer.local.auth import ClientAuth
from splitinfer.model.shards import load_cloud, load_local
from splitinfer.netem import WanConfig, start_proxy_thread

from security.sec_helpers import F32, TOKEN_A, decode_with_hook, remote


def _via_proxy(tiny, settle, wan: WanConfig, config=F32, **remote_kw):
    shards, _ = tiny
    local = load_local(shards / "local")
    with ServerThread(load_cloud(shards / "cloud")) as server:
        port = int(server.url.rsplit(":", 1)[1])
        with start_proxy_thread("127.0.0.1", port, wan) as proxy:
            tokens, session = decode_with_hook(local, remote(local, f"ws://127.0.0.1:{proxy.port}", **remote_kw), config=config)
            stats = dict(proxy.proxy.stats)
        assert settle(lambda: len(server.server.table) == 0)  # the last session was closed, the cut ones resumed
    return tokens, session, stats


def recoveries(session) -> int:
    return sum(r.recoveries for r in session.records)


def test_config_rejects_bad_fault_settings():
    for bad in (dict(cut_after_bytes=-1), dict(cut_after_s=float("nan")), dict(spike_prob=1.5), dict(spike_ms=-1.0)):
        with pytest.raises(ValueError):
            WanConfig(**bad)
    assert "cutting the first 2" in WanConfig(cut_after_bytes=10, cut_connections=2).describe()


def test_connection_cut_after_n_bytes_mid_generation(tiny, settle):
    # ~23 KB cross the link in one uninterrupted generation. A cut that lands after the server ran a step but
    # before its reply arrived makes the resume inconsistent, so the client opens a fresh session and
    # re-prefills; either way each cut costs exactly one recovery and the output does not change.
    tokens, session, stats = _via_proxy(tiny, settle, WanConfig(cut_after_bytes=4000, cut_connections=3))
    assert tokens == tiny[1]
    print(f"cut after bytes: {stats['cuts']} cuts, {stats['connections']} connections, {recoveries(session)} recoveries")
    assert stats["cuts"] >= 2
    assert recoveries(session) == stats["cuts"]


def test_connection_cut_at_a_time_mid_generation(tiny, settle):
    # 22 round trips of >= 20 ms each take longer than 0.2 s, so the first connection dies mid-generation.
    tokens, session, stats = _via_proxy(tiny, settle, WanConfig(rtt_ms=20, cut_after_s=0.2, cut_connections=1))
    assert tokens == tiny[1]
    print(f"cut at time: {stats['cuts']} cuts, {stats['connections']} connections, {recoveries(session)} recoveries")
    assert stats["cuts"] == 1 and recoveries(session) >= 1


def test_delay_spikes_past_the_reply_timeout(tiny, settle):
    """A reply later than the timeout is given up on; the server ran that step, so the client re-prefills."""
    # One spike per direction of the first connection at most, so recovery is not hit again and again.
    wan = WanConfig(spike_ms=600, spike_prob=0.3, spike_count=1, seed=7)
    config = replace(F32, max_retries=8)
    tokens, session, stats = _via_proxy(tiny, settle, wan, config, reply_timeout_s=0.35)
    print(f"delay spikes: {stats['connections']} connections, {recoveries(session)} recoveries")
    assert tokens == tiny[1]
    assert recoveries(session) >= 1


@pytest.mark.slow  # a real outage of a real server on the wall clock (about a minute here)
def test_outage_is_bridged_by_backoff(tiny):
    """The server is gone for ~1 s; reconnect attempts back off until it is back."""
    shards, expected = tiny
    local, cloud = load_local(shards / "local"), load_cloud(shards / "cloud")
    port = free_port()
    servers = [ServerThread(cloud, ServerConfig(port=port))]
    restarted = threading.Event()

    def outage(i, session):
        if i == 5:
            servers[0].close()
            threading.Timer(1.0, lambda: (servers.append(ServerThread(cloud, ServerConfig(port=port))), restarted.set())).start()

    config = replace(F32, max_retries=10, retry_backoff_s=0.05, retry_backoff_max_s=0.4)
    try:
        tokens, session = decode_with_hook(local, remote(local, f"ws://127.0.0.1:{port}"), outage, config=config)
    finally:
        restarted.wait(10)
        servers[-1].close()
    print(f"1 s outage: {recoveries(session)} recoveries")
    assert tokens == expected
    assert recoveries(session) >= 2  # at least one attempt found nobody listening


def test_backoff_is_exponential_capped_and_jittered():
    config = replace(F32, retry_backoff_s=0.1, retry_backoff_max_s=1.0)
    for attempt, ceiling in [(0, 0.1), (1, 0.2), (3, 0.8), (4, 1.0), (9, 1.0)]:
        delays = [config.backoff_s(attempt) for _ in range(50)]
        assert all(ceiling / 2 <= d <= ceiling for d in delays)
        assert len(set(delays)) > 1


def test_gives_up_with_a_transport_error_when_nobody_listens(tiny):
    shards, _ = tiny
    local = load_local(shards / "local")
    config = replace(F32, max_retries=2, retry_backoff_s=0.01)
    with pytest.raises(TransportError, match="Is `splitinfer serve` running"):
        decode_with_hook(local, remote(local, f"ws://127.0.0.1:{free_port()}", open_timeout_s=2), config=config)


@pytest.mark.slow  # a server process
@pytest.mark.timing  # a bound on the recovery time (backoff included) is part of what it checks
def test_server_process_killed_and_restarted_over_tls(tiny, pki, token_file):
    """SIGKILL of a `splitinfer serve` child (TLS + token); a server with the same keys and tokens comes
    back on the same port (in-process, to save a second interpreter start): identical output."""
    shards, expected = tiny
    local = load_local(shards / "local")
    port = free_port()
    tls = dict(token_file=token_file, tls_cert=pki.server_cert, tls_key=pki.server_key, port=port)
    with ExitStack() as stack:
        url, proc = stack.enter_context(cloud_server(shards / "cloud", threads=1, **tls))
        assert url.startswith("wss://")
        auth = ClientAuth(token=TOKEN_A, ca_file=pki.ca)

        def kill(i, session):
            if i == 7:
                proc.kill()
                proc.wait(10)
                config = ServerConfig(
                    port=port, tokens=load_server_tokens(str(token_file)), tls_cert=pki.server_cert, tls_key=pki.server_key
                )
                stack.enter_context(ServerThread(load_cloud(shards / "cloud"), config))

        start = time.perf_counter()
        tokens, session = decode_with_hook(local, remote(local, url, auth), kill)
        assert time.perf_counter() - start < 120
    print(f"SIGKILL + restart: {recoveries(session)} recoveries")
    assert tokens == expected
    assert recoveries(session) >= 1
