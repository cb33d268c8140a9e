"""The compute thread's batching policy: grouping, no wait for a lone session, for a closed one or for one out of
phase, exact batched steps."""

from __future__ import annotations

import pytest
import torch

from splitinfer.cloud.scheduler import BatchConfig, Cadence, Scheduler, plan_groups
from splitinfer.cloud.server import ServerConfig, ServerThread
from splitinfer.cloud.sessions import SessionConfig, SessionTable
from splitinfer.errors import ProtocolError
from splitinfer.local.middle import RemoteMiddle
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


def test_cadence_says_when_the_next_step_is_due():
    first = Cadence(10.0)
    assert first.due_by(0.0, 0.0)  # no gap yet: it may come at any time
    steady = first.after(10.1)  # every 0.1 s
    assert steady == Cadence(10.1, pytest.approx(0.1))
    assert steady.due_by(10.2, 0.0) and steady.due_by(10.19, 0.01)  # back by the deadline, or within the slack
    assert not steady.due_by(10.15, 0.01)  # back only after the window and its slack: nobody waits for it


def test_a_closed_session_is_not_waited_for(half):
    """On a clock that never moves a window entered never ends: once `forget` says the first session closed,
    the second one's steps come back at once (had it been waited for, the step would time out below)."""
    table = SessionTable(half, SessionConfig())
    scheduler = Scheduler(table, BatchConfig(window_ms=500), clock=FakeClock())
    try:
        gone, session = open_sessions(table, 2)
        scheduler.submit(gone, prefill_step(3, 0), 0.0).result(timeout=30)
        table.close(gone.id)
        scheduler.forget(gone.id)
        scheduler.submit(session, prefill_step(4, 1), 0.0).result(timeout=5)
        scheduler.submit(session, decode_step(1, tuple(range(4)), 4, 2), 0.0).result(timeout=5)
        assert scheduler.stats()["window_waits"] == 0
    finally:
        scheduler.close()


class CountingClock(FakeClock):
    """A FakeClock that counts its readings: the window's wait reads it on every turn of its loop."""

    readings = 0

    def __call__(self) -> float:
        self.readings += 1
        return super().__call__()


def test_the_window_waits_only_for_a_session_that_is_due(half, settle):
    """Session A steps every 0.1 s. B, stepping halfway between, runs at once (A comes back only after the
    window); B stepping just before A is due waits for A, and both run in one pass."""
    clock = CountingClock()
    table = SessionTable(half, SessionConfig())
    scheduler = Scheduler(table, BatchConfig(window_ms=2, active_horizon_s=10), clock=clock)
    try:
        a, b = open_sessions(table, 2)
        scheduler.submit(a, prefill_step(3, 0), 0.0).result(timeout=30)
        clock.advance(0.1)
        scheduler.submit(a, decode_step(1, tuple(range(3)), 3, 1), 0.0).result(timeout=30)
        clock.advance(0.05)  # A is due at 0.2; the window would end at 0.152
        scheduler.submit(b, prefill_step(4, 2), 0.0).result(timeout=5)
        assert scheduler.stats()["window_waits"] == 0
        clock.advance(0.049)  # now A is due within the window: B's step waits for it (the clock stands still)
        before = clock.readings
        waiting = scheduler.submit(b, decode_step(1, tuple(range(4)), 4, 3), 0.0)
        assert settle(lambda: clock.readings >= before + 4)  # the window's loop turning, B inside it
        assert not waiting.done()
        scheduler.submit(a, decode_step(2, (0,), 4, 4), 0.0).result(timeout=30)
        waiting.result(timeout=30)
        # B's step ran in one pass with A's: it waited (its window never ends while the clock stands still)
        assert scheduler.batch_sizes.get(2) == 1 and scheduler.stats()["window_waits"] == 1, scheduler.stats()
    finally:
        scheduler.close()


def test_the_server_forgets_a_closed_session(half, settle):
    """Through the server: a session that closed makes no later lone session wait (its steps would each spend
    the 300 ms window waiting for it while it still counted as recently active)."""
    with ServerThread(half, ServerConfig(port=0, batching=BatchConfig(window_ms=300))) as server:
        stack = half.stack

        def client():
            middle = RemoteMiddle(server.url, half.fingerprint, (stack.start, stack.end), 64, "float32")
            middle.open()
            middle.step(prefill_step(4, 0))
            return middle

        client().close()
        assert settle(lambda: len(server.server.table) == 0)
        middle = client()
        middle.step(decode_step(1, tuple(range(4)), 4, 1))
        middle.close()
        assert server.server.scheduler.stats()["window_waits"] == 0


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
