"""The compute thread's batching policy: grouping, no wait for a lone session, exact batched steps."""

from __future__ import annotations

import pytest
import torch

from splitinfer.cloud.scheduler import BatchConfig, Scheduler, plan_groups
from splitinfer.cloud.sessions import SessionConfig, SessionTable
from splitinfer.errors import ProtocolError
from splitinfer.masks import BlockStructure
from splitinfer.model.shards import load_cloud
from splitinfer.wire.messages import Hello, Step

from clock import FakeClock
from tiny import prepare_tiny


def test_plan_groups_keeps_padding_small():
    config = BatchConfig(pad_slack=1.5, max_batch=64, max_rows=4096)
    # sixteen decode steps and one prefill chunk: two passes, not one padded to 17 x 512 rows
    groups = plan_groups([1] * 16 + [512], config)
    assert sorted(len(g) for g in groups) == [1, 16]
    assert [16] in groups
    # similar sizes share a pass; every index appears exactly once
    groups = plan_groups([4, 5, 1, 6, 1, 64], config)
    assert sorted(i for g in groups for i in g) == list(range(6))
    assert any(set(g) == {0, 1, 3} for g in groups)
    assert plan_groups([], config) == []


def test_plan_groups_respects_limits():
    assert [len(g) for g in plan_groups([1] * 10, BatchConfig(max_batch=4))] == [4, 4, 2]
    assert [len(g) for g in plan_groups([8] * 5, BatchConfig(max_rows=16))] == [2, 2, 1]
    assert [len(g) for g in plan_groups([1] * 5, BatchConfig(max_batch=1))] == [1] * 5


@pytest.fixture(scope="module")
def half(tmp_path_factory):
    _, shards = prepare_tiny(tmp_path_factory.mktemp("sched"), "mistral", 1, 1)
    return load_cloud(shards / "cloud")


def open_sessions(table, n):
    hello = Hello(table.half.fingerprint, (table.half.stack.start, table.half.stack.end), "float32")
    return [table.open(hello)[0] for _ in range(n)]


def prefill_step(length: int, seed: int) -> Step:
    hidden = torch.randn(length, 64, generator=torch.Generator().manual_seed(seed))
    return Step(0, (), tuple(range(length)), BlockStructure.chain(), hidden, "float32")


def decode_step(seq: int, keep: tuple[int, ...], position: int, seed: int) -> Step:
    hidden = torch.randn(1, 64, generator=torch.Generator().manual_seed(seed))
    return Step(seq, keep, (position,), BlockStructure.chain(), hidden, "float32")


def test_lone_session_does_not_wait_for_the_window(half):
    """A lone session's step comes back at once, with no one else to wait for: on a clock that never moves, a
    window entered would never end, so a step that waited would time out below."""
    table = SessionTable(half, SessionConfig())
    scheduler = Scheduler(table, BatchConfig(window_ms=500), clock=FakeClock())
    try:
        (session,) = open_sessions(table, 1)
        scheduler.submit(session, prefill_step(5, 0), 0.0).result(timeout=30)
        for i in range(5):
            step = decode_step(i + 1, (0,) if i else tuple(range(5)), 5 + i, i)
            scheduler.submit(session, step, 0.0).result(timeout=30)
        assert scheduler.batch_sizes == {1: 6}
    finally:
        scheduler.close()


def test_burst_of_steps_is_batched_and_exact(half, settle):
    """Eight sessions (different lengths) submit at once (queued while the compute thread is held): fewer
    passes than steps, lone-identical rows; a step with a wrong seq fails alone."""
    lengths = [3, 7, 12, 15, 20, 1, 9, 30]
    lone_table = SessionTable(half, SessionConfig())
    lone = open_sessions(lone_table, len(lengths))
    table = SessionTable(half, SessionConfig())
    scheduler = Scheduler(table, BatchConfig(window_ms=50))
    try:
        blocker, *sessions = open_sessions(table, len(lengths) + 1)
        for i, n in enumerate(lengths):
            lone_table.run_step(lone[i], prefill_step(n, i), 0.0)
            scheduler.submit(sessions[i], prefill_step(n, i), 0.0).result(timeout=30)
        passes_before = scheduler.passes
        futures = []
        with blocker.lock:  # hold the compute thread inside a pass, so that the burst queues whole
            held = scheduler.submit(blocker, prefill_step(4, 0), 0.0)
            assert settle(held.running)
            for i, n in enumerate(lengths):
                seq = 5 if i == 3 else 1  # session 3 sends an out-of-order step
                futures.append(scheduler.submit(sessions[i], decode_step(seq, tuple(range(n)), n, 100 + i), 0.0))
        held.result(timeout=30)
        passes_before += 1  # the blocker's pass
        for i, (future, n) in enumerate(zip(futures, lengths)):
            if i == 3:
                with pytest.raises(ProtocolError, match="out of order"):
                    future.result(timeout=30)
                continue
            want = lone_table.run_step(lone[i], decode_step(1, tuple(range(n)), n, 100 + i), 0.0).hidden
            torch.testing.assert_close(future.result(timeout=30).hidden, want, atol=2e-5, rtol=0)
        assert scheduler.passes - passes_before < len(lengths) - 1, scheduler.stats()
        assert max(scheduler.batch_sizes) > 1
        # claims are released just after the futures are answered
        assert settle(lambda: all(s.busy == 0 for s in sessions))
    finally:
        scheduler.close()


def test_cancelled_step_is_skipped(half, settle):
    """A step cancelled while queued (its connection went away) is not run; the session can go on."""
    table = SessionTable(half, SessionConfig())
    scheduler = Scheduler(table, BatchConfig(window_ms=0))
    try:
        blocker, session = open_sessions(table, 2)
        with blocker.lock:  # hold the compute thread inside a pass on `blocker`
            busy = scheduler.submit(blocker, prefill_step(4, 0), 0.0)
            # running: the compute thread took it and waits on the lock; the next step can only queue
            assert settle(busy.running)
            queued = scheduler.submit(session, prefill_step(3, 1), 0.0)
            assert queued.cancel()
        busy.result(timeout=30)
        # Had the cancelled step run, this second seq-0 step would be refused as out of order.
        scheduler.submit(session, prefill_step(3, 1), 0.0).result(timeout=30)
        assert session.next_seq == 1
        # claims are released just after the futures are answered
        assert settle(lambda: session.busy == blocker.busy == 0)
    finally:
        scheduler.close()
