"""The compute thread of the cloud server: gathers the pending steps of concurrent sessions into batches.

Policy: a step that arrives while the worker is idle runs at once, so a lone session waits for nothing
but a thread hand-off. Steps that arrive while a batch is computing queue up and run together in the
next pass. A short window (`window_ms`) is spent waiting for more only while another session is due: it
stepped recently (`active_horizon_s`), has not queued, has not closed (`forget`), and its own cadence (the
gap between its last two steps) brings its next step back within the window, give or take one window of
jitter. A session out of phase with the others, or one that closed, makes nobody wait: on a GPU, whose
step lasts a few ms, a window spent for nothing is a large share of a step.

Queued steps are cut into groups of similar block size (`plan_groups`), because a batch is padded to its
largest block: sixteen one-row decode steps and one 512-row prefill chunk are two passes, not one pass of
17 x 512 rows. Sessions with different head depths (split-point randomisation) run different layers,
so they are never put in one pass either. Results go to `concurrent.futures.Future`s (awaitable from asyncio via `run`).
A step submitted with `skip` (its client already dropped its block: wire/serverlink.py `dropped`) is applied on
this thread like the others, in its turn, but joins no pass (`SessionTable.skip_step`).

This module knows nothing about sockets or the wire; it calls `SessionTable.run_steps`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from ..errors import SplitInferError
from ..wire.messages import Step
from .sessions import CloudSession, SessionTable

log = logging.getLogger("splitinfer.cloud")


@dataclass(frozen=True)
class BatchConfig:
    window_ms: float = 2.0  # longest wait for more steps, spent only while other recent sessions have not queued
    max_batch: int = 64  # steps in one forward pass (1 disables batching: one session at a time)
    max_rows: int = 4096  # padded rows (steps x largest block) in one forward pass
    pad_slack: float = 1.5  # a group's padded rows may exceed its real rows by this factor
    active_horizon_s: float = 1.0  # a session that stepped this recently is expected to step again

    def __post_init__(self):
        if self.window_ms < 0 or self.max_batch < 1 or self.max_rows < 1 or self.pad_slack < 1:
            raise ValueError("batch window must be >= 0, max batch and rows >= 1, padding slack >= 1.")


def plan_groups(rows: Sequence[int], config: BatchConfig) -> list[list[int]]:
    """Indices of `rows` (block sizes) cut into passes: sorted by size, a block joins the current group while
    the padded size (count x largest) stays within `pad_slack` x the real rows and within the limits."""
    groups: list[list[int]] = []
    current: list[int] = []
    real = 0
    for i in sorted(range(len(rows)), key=lambda i: rows[i]):
        q = rows[i]
        padded = (len(current) + 1) * q
        fits = (
            len(current) < config.max_batch
            and padded <= config.max_rows
            and padded <= config.pad_slack * (real + q)
        )
        if current and not fits:
            groups.append(current)
            current, real = [], 0
        current.append(i)
        real += q
    if current:
        groups.append(current)
    return groups


@dataclass(frozen=True)
class Cadence:
    """When a session last submitted a step, and the gap before it (None after its first)."""

    last: float
    gap: float | None = None

    def after(self, now: float) -> "Cadence":
        """The cadence once the session submits again at `now`."""
        return Cadence(now, now - self.last)

    def due_by(self, deadline: float, slack: float) -> bool:
        """Whether its next step, one gap after its last, is expected by `deadline` (give or take `slack`).
        A session with no gap yet may come at any time: it is due."""
        return self.gap is None or self.last + self.gap <= deadline + slack


@dataclass
class _Item:
    session: CloudSession
    step: Step
    received_at: float
    skip: bool = False  # apply the step, run no block: the client dropped it
    future: Future = field(default_factory=Future)


class Scheduler:
    """One compute thread over a SessionTable; `submit` from any thread, `run` from an event loop."""

    def __init__(self, table: SessionTable, config: BatchConfig = BatchConfig(), finish: Callable = lambda r: r,
                 clock: Callable[[], float] = time.monotonic):
        self.table = table
        self.config = config
        self.clock = clock  # seconds, monotonic: the batch window and the active horizon; tests pass a fake one
        self._finish = finish  # runs on the compute thread (e.g. encoding the reply off the event loop)
        self._queue: list[_Item] = []
        self._cond = threading.Condition()
        self._closed = False
        self._recent: dict[str, Cadence] = {}  # session id -> when it stepped lately, and how often
        self.passes = 0  # forward passes run
        self.steps = 0  # steps run
        self.batch_sizes: dict[int, int] = {}  # steps per pass -> how many passes had that many
        self.window_waits = 0  # passes that spent some of the batch window waiting for another session
        self.window_wait_s = 0.0  # seconds spent so (on `clock`)
        self._thread = threading.Thread(target=self._loop, name="splitinfer-compute", daemon=True)
        self._thread.start()

    def submit(self, session: CloudSession, step: Step, received_at: float, skip: bool = False) -> Future:
        item = _Item(session, step, received_at, skip)
        self.table.claim(session)
        with self._cond:
            if self._closed:
                self.table.release(session)
                raise RuntimeError("the scheduler is closed")
            self._queue.append(item)
            now = self.clock()
            cadence = self._recent.get(session.id)
            self._recent[session.id] = Cadence(now) if cadence is None else cadence.after(now)
            self._cond.notify()
        return item.future

    async def run(self, session: CloudSession, step: Step, received_at: float, skip: bool = False):
        return await asyncio.wrap_future(self.submit(session, step, received_at, skip))

    def forget(self, session_id: str) -> None:
        """The session closed: no pass waits for its next step any more."""
        with self._cond:
            self._recent.pop(session_id, None)

    def _awaited_locked(self, batch: list[_Item], deadline: float, slack: float) -> bool:
        """Whether a session outside `batch` is due before `deadline` (module docstring). Hold the lock."""
        horizon = self.clock() - self.config.active_horizon_s
        for sid in [sid for sid, cadence in self._recent.items() if cadence.last < horizon]:
            del self._recent[sid]
        present = {item.session.id for item in batch}
        return any(cadence.due_by(deadline, slack) for sid, cadence in self._recent.items() if sid not in present)

    def _take_locked(self, batch: list[_Item]) -> None:
        """Move queued items into `batch`, one per session, up to max_batch; the rest stay in order."""
        kept: list[_Item] = []
        for item in self._queue:
            if len(batch) < self.config.max_batch and all(b.session is not item.session for b in batch):
                batch.append(item)
            else:
                kept.append(item)
        self._queue = kept

    def _gather(self) -> list[_Item] | None:
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if not self._queue:
                return None
            batch: list[_Item] = []
            self._take_locked(batch)
            if self.config.window_ms > 0 and self.config.max_batch > 1:
                window = self.config.window_ms / 1e3
                start = self.clock()
                deadline = start + window
                waited = False
                while len(batch) < self.config.max_batch and self._awaited_locked(batch, deadline, window):
                    left = deadline - self.clock()
                    if left <= 0 or self._closed:
                        break
                    self._cond.wait(left)
                    waited = True
                    self._take_locked(batch)
                if waited:
                    self.window_waits += 1
                    self.window_wait_s += self.clock() - start
            return batch

    def _loop(self) -> None:
        while (batch := self._gather()) is not None:
            # A step whose connection went away while it queued was cancelled: skip it, so that the client
            # can resume its session where it left off. The others can no longer be cancelled from here on.
            for item in batch:
                if not item.future.set_running_or_notify_cancel():
                    self.table.release(item.session)
            batch = [item for item in batch if item.future.running()]
            for item in [item for item in batch if item.skip]:
                self._skip(item)
            batch = [item for item in batch if not item.skip]
            for depth in sorted({item.session.head_layers for item in batch}):
                same = [item for item in batch if item.session.head_layers == depth]
                for group in plan_groups([len(item.step.positions) for item in same], self.config):
                    self._run([same[i] for i in group])

    def _skip(self, item: _Item) -> None:
        try:
            outcome = self.table.skip_step(item.session, item.step, item.received_at)
        except Exception as exc:  # noqa: BLE001 - an unexpected failure fails this step, not the server
            log.exception("a skipped step failed")
            outcome = exc
        finally:
            self.table.release(item.session)
        self._settle(item, outcome)

    def _settle(self, item: _Item, outcome) -> None:
        if isinstance(outcome, Exception):
            item.future.set_exception(outcome)
            return
        try:
            item.future.set_result(self._finish(outcome))
        except SplitInferError as exc:  # e.g. values the wire dtype cannot hold
            item.future.set_exception(exc)

    def _run(self, items: list[_Item]) -> None:
        try:
            outcomes = self.table.run_steps([(it.session, it.step, it.received_at) for it in items])
            self.passes += 1
            self.steps += len(items)
            self.batch_sizes[len(items)] = self.batch_sizes.get(len(items), 0) + 1
        except Exception as exc:  # noqa: BLE001 - an unexpected failure fails this pass, not the server
            log.exception("a batched pass of %d step(s) failed", len(items))
            outcomes = [exc] * len(items)
        finally:
            # Released before any reply goes out: a client that closes right after its reply must find
            # its session idle, so that closing frees the buffers at once (outputs do not alias the cache).
            for item in items:
                self.table.release(item.session)
        for item, outcome in zip(items, outcomes):
            self._settle(item, outcome)

    def stats(self) -> dict:
        return {
            "passes": self.passes,
            "steps": self.steps,
            "mean_batch": round(self.steps / self.passes, 3) if self.passes else 0.0,
            "batch_sizes": dict(sorted(self.batch_sizes.items())),
            "window_waits": self.window_waits,
            "window_wait_ms": round(self.window_wait_s * 1e3, 3),
        }

    def close(self) -> None:
        """Finish what is queued, then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=60)
