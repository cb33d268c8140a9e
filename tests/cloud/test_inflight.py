"""Blocks in flight on the cloud: pending blocks held in order, resolved oldest first, dropped when their
assumption failed; a block run ahead computes what it would have computed after its predecessor resolved."""

from __future__ import annotations

import pytest
import torch

from splitinfer.cloud.sessions import SessionConfig, SessionTable
from splitinfer.errors import ProtocolError
from splitinfer.kv import KVCache
from splitinfer.masks import BlockStructure
from splitinfer.model.shards import load_cloud
from splitinfer.wire.messages import PIPELINE_VERSION, Assumed, Hello, Step

from tiny import prepare_tiny

D = 64


def rows_of(cache: KVCache, end: int) -> torch.Tensor:
    return cache._keys[0][0, 0, :end, 0].clone()


def write(cache: KVCache, values: list[float]) -> None:
    key = torch.tensor(values, dtype=torch.float32).view(1, 1, len(values), 1)
    cache.update(key, key.clone(), 0)


def test_held_blocks_resolve_oldest_first_and_shift_later_rows_down():
    cache = KVCache(1, initial_capacity=4)
    write(cache, [0, 1])
    cache.keep([0, 1])
    write(cache, [10, 11, 12])  # block a
    cache.hold()
    write(cache, [20, 21])  # block b, written after a
    cache.hold()
    write(cache, [30])  # block c
    cache.hold()
    assert (cache.length, cache.held, cache.held_rows) == (2, [3, 2, 1], 6)
    cache.keep([0, 2])  # a keeps two rows; b and c move down behind them
    assert (cache.length, cache.held) == (4, [2, 1])
    assert rows_of(cache, 7).tolist() == [0, 1, 10, 12, 20, 21, 30]
    cache.keep([0])
    assert rows_of(cache, 6).tolist() == [0, 1, 10, 12, 20, 30]
    cache.drop_newer(0)  # c's assumption failed
    assert (cache.length, cache.held, cache.pending) == (5, [], 0)
    write(cache, [40])
    assert rows_of(cache, 6).tolist() == [0, 1, 10, 12, 20, 40]


@pytest.fixture(scope="module", params=["llama", "mistral"])
def table(request, tmp_path_factory):
    _, shards = prepare_tiny(tmp_path_factory.mktemp("inflight"), request.param, 2, 2)
    half = load_cloud(shards / "cloud")
    return SessionTable(half, SessionConfig(max_in_flight=3))


def open_session(table: SessionTable, version: int = PIPELINE_VERSION):
    hello = Hello(table.half.fingerprint, (table.half.stack.start, table.half.stack.end), "float32", version=version)
    return table.open(hello)


def tree(q: int) -> BlockStructure:
    return BlockStructure.tree([-1] + [0] * (q - 1))  # a root and q - 1 children


def test_a_block_run_ahead_equals_the_block_run_after_its_predecessor(table):
    torch.manual_seed(0)
    prompt, a, b, c = torch.randn(14, D), torch.randn(3, D), torch.randn(2, D), torch.randn(1, D)
    # one block at a time: a (a root and two children), keep rows 0 and 2, then b, keep both, then c
    alone, welcome = open_session(table, version=1)
    assert welcome.max_in_flight == 1
    run = lambda seq, keep, positions, hidden, structure: table.run_step(  # noqa: E731
        alone, Step(seq, keep, positions, structure, hidden, "float32"), 0.0).hidden
    run(0, (), tuple(range(14)), prompt, BlockStructure.chain())
    run(1, tuple(range(14)), (14, 15, 15), a, tree(3))
    want_b = run(2, (0, 2), (16, 17), b, BlockStructure.chain())
    want_c = run(3, (0, 1), (18,), c, BlockStructure.chain())
    table.close(alone.id)
    # in flight: b goes assuming a keeps rows 0 and 2, c assuming b keeps both; then a and b resolve
    session, welcome = open_session(table)
    assert (welcome.version, welcome.max_in_flight) == (PIPELINE_VERSION, 3)
    step = lambda seq, keep, positions, hidden, structure, assume=(): table.run_step(  # noqa: E731
        session, Step(seq, keep, positions, structure, hidden, "float32", assume), 0.0)
    step(0, (), tuple(range(14)), prompt, BlockStructure.chain())
    step(1, tuple(range(14)), (14, 15, 15), a, tree(3))
    got_b = step(2, (), (16, 17), b, BlockStructure.chain(), (Assumed(1, (0, 2)),))
    assert got_b.committed == 14 and session.cache.held == [3, 2]
    got_c = step(3, (), (18,), c, BlockStructure.chain(), (Assumed(1, (0, 2)), Assumed(2, (0, 1))))
    assert table.stats()["kv_pending_tokens"] == 6 and table.stats()["kv_committed_tokens"] == 14
    torch.testing.assert_close(got_b.hidden, want_b, atol=2e-5, rtol=0)
    torch.testing.assert_close(got_c.hidden, want_c, atol=2e-5, rtol=0)
    # a resolves as assumed, b does not: c is dropped, and the next step builds on b's real path
    step(4, (0, 2), (18, 19), torch.randn(2, D), BlockStructure.chain(), (Assumed(2, (0, 1)),))
    with pytest.raises(ProtocolError, match="valid blocks in flight"):
        step(5, (0,), (17,), c, BlockStructure.chain(), (Assumed(4, (0,)),))
    assert session.next_seq == 5 and session.cache.length == 16  # the refused step changed nothing
    step(5, (0,), (17,), c, BlockStructure.chain())
    assert (session.cache.length, session.cache.held, [b.seq for b in session.pending]) == (17, [1], [5])
    table.close(session.id)


def test_a_batched_pass_runs_blocks_in_flight_as_lone_steps_do(table):
    """Two sessions, each with a block in flight, in one batched pass: each gets its lone-step rows."""
    torch.manual_seed(1)
    prompts = [torch.randn(9, D), torch.randn(5, D)]
    firsts = [torch.randn(3, D), torch.randn(2, D)]
    aheads = [torch.randn(2, D), torch.randn(1, D)]
    sessions, outs = [], {}
    for batched in (False, True):
        sessions = [open_session(table)[0] for _ in prompts]
        items = []
        for session, prompt, first, nxt in zip(sessions, prompts, firsts, aheads):
            n = prompt.shape[0]
            table.run_step(session, Step(0, (), tuple(range(n)), BlockStructure.chain(), prompt, "float32"), 0.0)
            table.run_step(session, Step(1, tuple(range(n)), tuple([n] + [n + 1] * (first.shape[0] - 1)),
                                         tree(first.shape[0]), first, "float32"), 0.0)
            positions = tuple(range(n + 2, n + 2 + nxt.shape[0]))
            items.append((session, Step(2, (), positions, BlockStructure.chain(), nxt, "float32",
                                        (Assumed(1, (0, 1)),)), 0.0))
        results = table.run_steps(items) if batched else [table.run_step(*item) for item in items]
        outs[batched] = [r.hidden for r in results]
        for session in sessions:
            table.close(session.id)
    for lone, batched in zip(outs[False], outs[True]):
        torch.testing.assert_close(batched, lone, atol=2e-5, rtol=0)
