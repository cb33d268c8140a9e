"""The KV memory budget: byte accounting, LRU eviction of idle sessions, refusal, and client recovery."""

from __future__ import annotations

import pytest
import torch

from splitinfer.cloud.server import ServerConfig, ServerThread
from splitinfer.cloud.sessions import SessionConfig, SessionTable
from splitinfer.decoding.loop import decode
from splitinfer.decoding.strategies import Sequential
from splitinfer.errors import CapacityError, SessionError
from splitinfer.local.middle import RemoteMiddle
from splitinfer.local.session import ClientConfig, SplitSession
from splitinfer.masks import BlockStructure
from splitinfer.model.shards import load_cloud, load_local
from splitinfer.wire.messages import Hello, Step

from tiny import prepare_tiny

PROMPT = [3, 17, 42, 5, 88, 21, 9, 60, 33, 7, 14, 2, 71]
F32 = ClientConfig(wire_dtype="float32", prefill_chunk=8, retry_backoff_s=0.01)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model, shards = prepare_tiny(tmp_path_factory.mktemp("budget"), "qwen2", 2, 2)
    expected = model.generate(
        torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return shards, expected[0, len(PROMPT) :].tolist()


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def opened(table, n):
    hello = Hello(table.half.fingerprint, (table.half.stack.start, table.half.stack.end), "float32")
    return [table.open(hello)[0] for _ in range(n)]


def step(rows: int, seq: int = 0) -> Step:
    return Step(seq, (), tuple(range(rows)), BlockStructure.chain(), torch.randn(rows, 64), "float32")


def test_reserved_bytes_are_the_allocated_bytes(tiny):
    shards, _ = tiny
    half = load_cloud(shards / "cloud")
    table = SessionTable(half, SessionConfig())
    # 2 layers x (k + v) x 2 kv heads x 16 dims x 4 bytes
    assert table.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    a, b = opened(table, 2)
    table.run_step(a, step(5), 0.0)
    table.run_step(b, step(300), 0.0)  # past the first 256-row buffer: doubled to 512
    stats = table.stats()
    assert stats["kv_allocated_bytes"] == stats["kv_reserved_bytes"] == (256 + 512) * table.kv_bytes_per_token
    assert stats["kv_tokens"] == 305 and stats["sessions"] == 2 and stats["evictions"] == 0
    table.close(a.id)
    assert table.stats()["kv_allocated_bytes"] == 512 * table.kv_bytes_per_token


def test_idle_sessions_are_evicted_lru_before_refusing(tiny):
    shards, _ = tiny
    half = load_cloud(shards / "cloud")
    per_session = 256 * half.stack.kv_bytes_per_token()
    clock = Clock()
    table = SessionTable(half, SessionConfig(max_kv_bytes=2 * per_session, evict_idle_s=10.0), clock=clock)
    a, b, c = opened(table, 3)
    table.run_step(a, step(4), 0.0)
    clock.now = 1.0
    table.run_step(b, step(4), 0.0)
    clock.now = 5.0
    with pytest.raises(CapacityError, match="KV budget"):  # a and b are not idle long enough to go
        table.run_step(c, step(4), 0.0)
    assert table.stats()["refusals"] == 1 and len(table) == 3
    clock.now = 12.0
    table.claim(a)  # a has a step queued: in use, so the idle b goes although a is older
    table.run_step(c, step(4), 0.0)
    table.release(a)
    stats = table.stats()
    assert stats["evictions"] == 1 and stats["kv_reserved_bytes"] <= 2 * per_session
    with pytest.raises(SessionError, match="re-prefill"):
        table.get(b.id)
    assert b.cache.nbytes() == 0  # released at once, even while a connection still holds the object
    # LRU among idle sessions: a (last used at 0) goes before c (last used at 12)
    (d,) = opened(table, 1)
    clock.now = 30.0
    table.run_step(d, step(4), 0.0)
    assert table.get(c.id) is c
    with pytest.raises(SessionError):
        table.get(a.id)


def test_session_limit_evicts_an_idle_session(tiny):
    shards, _ = tiny
    clock = Clock()
    table = SessionTable(load_cloud(shards / "cloud"), SessionConfig(max_sessions=2, evict_idle_s=1.0), clock=clock)
    a, b = opened(table, 2)
    with pytest.raises(CapacityError, match="retry later"):
        opened(table, 1)
    clock.now = 2.0
    (c,) = opened(table, 1)
    assert len(table) == 2 and table.stats()["evictions"] == 1


def test_evicted_client_recovers_with_identical_output(tiny):
    """A budget for about one session: a second client evicts the first, which re-prefills transparently."""
    shards, expected = tiny
    local = load_local(shards / "local")
    half = load_cloud(shards / "cloud")
    sessions = SessionConfig(max_kv_bytes=300 * half.stack.kv_bytes_per_token(), evict_idle_s=0.0)
    split = local.manifest["split"]

    def middle(url):
        return RemoteMiddle(url, local.fingerprint, tuple(split["cloud_layers"]), 64, "float32")

    with ServerThread(half, ServerConfig(port=0, sessions=sessions)) as server:
        first = SplitSession(local, middle(server.url), F32)
        tokens: list[int] = []

        def emit(token, _logprob):
            tokens.append(token)
            if len(tokens) == 5:  # meanwhile another client takes the memory
                other = SplitSession(local, middle(server.url), F32)
                got: list[int] = []
                decode(other, PROMPT, other.prefill(PROMPT), 16, set(), lambda t, _: got.append(t), Sequential())
                assert got == expected
                assert server.server.table.stats()["evictions"] == 1

        decode(first, PROMPT, first.prefill(PROMPT), 16, set(), emit, Sequential())
        stats = server.server.table.stats()
    assert tokens == expected
    assert sum(r.recoveries for r in first.records) >= 1
    assert stats["evictions"] >= 2  # the first client took its room back from the idle second one
