"""Cloud sessions: per-session KV cache of the middle layers, TTL, capacity budget, step execution.

This module holds the cloud's sessions and is free of I/O: the server adapter calls `open` and
`expire`, and its compute thread (scheduler.py) calls `run_steps` with the steps of several sessions,
which batch.py runs in one pass. The KV budget (rows and bytes) is charged per session when a step is
validated; idle sessions are evicted, least recently used first, before anything is refused. A session
outlives its connection, so a client whose link dropped can resume it; one that expired, was evicted or
was lost in a restart is rebuilt by the client (re-prefill). What a peer may send (seq order, keep
lists, positions, what a resume may not change) is the link protocol's rule (wire/serverlink.py), applied here
to each session's state.

Blocks in flight (a v3 hello): a session keeps every block it ran whose rows the client has not resolved,
in order, with its KV rows held after the committed ones (kv.py `hold`). A step resolves the oldest (its
keep list) unless it assumes it, builds on the pending blocks it assumes (they must be the next ones, each
still valid) and drops the rest; its rows see the committed rows and the assumed rows of the blocks it
builds on (wire/inflight.py). Budgets and metrics count committed and pending rows separately. A step that
a later, already received step shows the client dropped (wire/serverlink.py `dropped`) is `skip_step`ped: checked
and its resolutions applied like any other, its block never computed, its reply without rows.

Under split-point randomisation the hello pins the session's head depth k inside the shard's range; the
session then runs layers [k, N-m) only (`CloudHalf.stack_for`), its cache and budget cover those layers,
and a resume cannot change k. Steps of sessions with different k never share a forward pass.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..errors import CapacityError, ProtocolError, SessionError, ShardMismatch, SplitInferError, VersionMismatch
from ..hfconfig import context_limit
from ..kv import KVCache
from ..model.shards import CloudHalf
from ..wire.inflight import Prefix
from ..wire.serverlink import PendingBlock, check_resume, check_step
from ..wire.messages import PIPELINE_VERSION, SUPPORTED_VERSIONS, Hello, Result, Step, Welcome
from .batch import Block, LocalPasses

UNNAMED_CONTEXT = 1 << 20  # a session's rows where the model's config names no context length

log = logging.getLogger("splitinfer.cloud")


@dataclass(frozen=True)
class SessionConfig:
    ttl_s: float = 300.0  # idle time after which a session and its cache are dropped
    max_sessions: int = 64  # open sessions at once; more get a retry-later error
    max_cached_tokens: int = 262_144  # KV rows over all sessions (committed + pending); the memory budget
    max_block_rows: int = 1024  # rows per step; also bounds prefill chunks
    max_message_bytes: int = 16 * 1024 * 1024  # WebSocket message limit, announced to clients
    max_kv_bytes: int | None = None  # KV buffer bytes over all sessions (allocated, not only used); None: no limit
    evict_idle_s: float = 2.0  # a session idle this long may be evicted to make room (its client re-prefills)
    max_sessions_per_owner: int | None = None  # sessions one token may hold at once, so one client cannot take all
    max_in_flight: int = 4  # blocks a v3 session may have pending at once (the client's in-flight depth)

    def __post_init__(self):
        if self.ttl_s <= 0 or self.max_sessions < 1 or self.max_cached_tokens < 1 or self.max_block_rows < 1:
            raise ValueError("session TTL, max sessions, cached-token budget and block rows must all be positive.")
        if not 1 <= self.max_in_flight <= 9:
            raise ValueError("blocks in flight per session must be between 1 and 9.")
        if (self.max_kv_bytes is not None and self.max_kv_bytes < 1) or self.evict_idle_s < 0:
            raise ValueError("the KV byte budget must be positive and the eviction idle time not negative.")


@dataclass
class CloudSession:
    id: str
    cache: KVCache
    wire_dtype: str
    last_used: float
    next_seq: int = 0
    pending: tuple[PendingBlock, ...] = ()  # blocks run but not resolved by the client, oldest first
    max_in_flight: int = 1  # blocks it may have pending at once: 1 unless its hello spoke v3
    owner: str = "anonymous"  # identity (token digest) that opened it; no other identity may use it
    head_layers: int = 0  # k: the client runs layers [0, k), this session runs [k, N-m); fixed for its life
    kv_bytes_per_token: int = 0  # KV bytes of one row over the layers this session runs
    reserved_rows: int = 0  # KV rows counted against the budget (those of the last step, committed + block)
    reserved_bytes: int = 0  # KV buffer bytes counted against the byte budget
    reserved_pending: int = 0  # of reserved_rows, rows of earlier blocks still in flight (not committed)
    busy: int = 0  # steps queued or running (guarded by the table lock); a busy session is never evicted
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def rows(self) -> int:
        return self.cache.length + self.cache.held_rows + self.cache.pending


class SessionTable:
    """All sessions of one server, over one CloudHalf. Thread-safe."""

    def __init__(self, half: CloudHalf, config: SessionConfig, clock: Callable[[], float] = time.monotonic,
                 passes: LocalPasses | None = None):
        self.half = half
        self.config = config
        self.clock = clock
        self.passes = passes or LocalPasses(half)  # makes the sessions' caches and runs their passes
        limit = context_limit(half.config)
        self.max_position = UNNAMED_CONTEXT if limit is None else int(limit)  # rows a session may reach
        self._sessions: dict[str, CloudSession] = {}
        self._lock = threading.Lock()
        device = next(half.stack.parameters()).device
        self._device = device
        self._dtype = half.stack.compute_dtype
        self.kv_bytes_per_token = half.stack.kv_bytes_per_token()
        self.evictions = 0  # sessions dropped to make room for others
        self.refusals = 0  # steps or sessions refused for lack of room
        self.skipped = 0  # steps whose block was dropped by the client before it ran (never computed)

    def __len__(self) -> int:
        with self._lock:  # `close` pops and frees under this lock: a session counted gone has its buffers gone
            return len(self._sessions)

    def cached_tokens(self) -> int:
        with self._lock:
            return sum(s.rows for s in self._sessions.values())

    def open(self, hello: Hello, owner: str = "anonymous") -> tuple[CloudSession, Welcome]:
        """Resume `hello.session_id` if `owner` opened it and it still exists; otherwise open a new session.

        Another identity's session id is treated exactly like an unknown one (a fresh session is opened), so
        a client learns nothing about sessions that are not its own.
        """
        if hello.version not in SUPPORTED_VERSIONS:
            raise VersionMismatch(
                f"client speaks protocol v{hello.version}, this server v{'/v'.join(map(str, SUPPORTED_VERSIONS))}; "
                "upgrade the older side."
            )
        stack = self.half.stack
        if hello.fingerprint != self.half.fingerprint or tuple(hello.cloud_layers) != (stack.start, stack.end):
            raise ShardMismatch(
                f"this server holds layers [{stack.start}, {stack.end}) with shard fingerprint "
                f"{self.half.fingerprint[:12]}..., but the client expects layers {list(hello.cloud_layers)} with "
                f"{hello.fingerprint[:12]}...; serve the cloud shard prepared together with the client's local shard."
            )
        low, high = self.half.head_range
        head_layers = low if hello.head_layers is None else hello.head_layers
        if not low <= head_layers <= high:
            span = f"head depths {low}..{high}" if high > low else f"only head depth {low} (a fixed split)"
            raise ShardMismatch(
                f"the client pins head depth {head_layers} (cloud layers [{head_layers}, {stack.end})), but this "
                f"server's shard serves {span}; the client's local shard and this cloud shard disagree on the split."
            )
        now = self.clock()
        with self._lock:
            existing = self._sessions.get(hello.session_id) if hello.session_id is not None else None
            if existing is not None and existing.owner == owner:
                session = existing
                check_resume(hello, session.wire_dtype, session.head_layers, head_layers)
                session.last_used = now
                resumed = True
            else:
                cap = self.config.max_sessions_per_owner
                if cap is not None and sum(s.owner == owner for s in self._sessions.values()) >= cap:
                    self.refusals += 1
                    raise CapacityError(
                        f"this client already holds {cap} sessions, its limit on this server; close one "
                        "(or let it expire) and retry later."
                    )
                if len(self._sessions) >= self.config.max_sessions and not self._evict_one_locked(None):
                    self.refusals += 1
                    raise CapacityError(
                        f"the server is at its limit of {self.config.max_sessions} sessions; retry later."
                    )
                runs = self.half.stack_for(head_layers)
                session = CloudSession(
                    id=secrets.token_urlsafe(18), cache=self.passes.new_cache(head_layers),
                    wire_dtype=hello.wire_dtype, last_used=now,
                    owner=owner, head_layers=head_layers, kv_bytes_per_token=runs.kv_bytes_per_token(),
                    max_in_flight=self.config.max_in_flight if hello.version >= PIPELINE_VERSION else 1,
                )
                self._sessions[session.id] = session
                resumed = False
        welcome = Welcome(
            session_id=session.id,
            committed=session.cache.length,
            resumed=resumed,
            max_message_bytes=self.config.max_message_bytes,
            max_block_rows=self.config.max_block_rows,
            next_seq=session.next_seq,
            version=hello.version,  # the version the hello spoke: a v1 client gets the v1 welcome it knows
            max_in_flight=session.max_in_flight,
        )
        return session, welcome

    def get(self, session_id: str, owner: str | None = None) -> CloudSession:
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None or (owner is not None and session.owner != owner):
            raise SessionError("the session is unknown to this server (expired or lost in a restart); re-prefill.")
        return session

    def close(self, session_id: str) -> None:
        with self._lock:  # freed under the table's lock: whoever sees the session gone sees its buffers gone
            session = self._sessions.pop(session_id, None)
            if session is not None:
                _free(session)  # never blocks: it skips a session whose lock is held

    def expire(self) -> list[str]:
        """Drop sessions idle for longer than the TTL; returns their ids."""
        deadline = self.clock() - self.config.ttl_s
        with self._lock:
            gone = [sid for sid, s in self._sessions.items() if s.last_used < deadline and not s.lock.locked()]
            for sid in gone:  # freed under the lock, as in `close`
                _free(self._sessions.pop(sid))
        if gone:
            log.info("expired %d idle session(s)", len(gone))
        return gone

    def _apply_step(self, session: CloudSession, step: Step, skip: bool = False) -> Prefix | None:
        """The protocol's rules for a step (wire/serverlink.py), the KV budget for the rows it brings, then its
        resolution and drops on the cache. Returns the pending rows the block is written after, if any; skip:
        the block will not run (it brings no rows)."""
        cache = session.cache
        plan = check_step(
            step, session.next_seq, session.wire_dtype, cache.length, session.pending, self.max_position,
            session.max_in_flight, skip,
        )
        held = sum(len(b.positions) for b in plan.pending)
        self._reserve(session, plan.committed + held + (0 if skip else len(step.positions)), held)
        for rows in plan.resolves:
            cache.keep(rows)
        cache.drop_newer(len(plan.pending))
        session.pending = plan.pending
        if not plan.pending:
            return None
        blocks = [(b.positions, a.rows) for b, a in zip(plan.pending, step.assume[step.resolved :])]
        return Prefix.of(blocks, self._device)

    # -- KV budget: reservation, eviction, numbers for metrics -----------------------------------------
    def _reserve(self, session: CloudSession, rows: int, pending: int = 0) -> None:
        """Count `session` at `rows` KV rows (`pending` of them in blocks in flight, not counting the new
        block), evicting idle sessions (least recently used first) if needed."""
        buffer_rows = rows + self.half.stack.spare_rows  # a compiled stack keeps one row spare (LayerStack)
        need_bytes = session.cache.projected_nbytes(buffer_rows, session.kv_bytes_per_token or self.kv_bytes_per_token)
        budget_bytes, budget_rows = self.config.max_kv_bytes, self.config.max_cached_tokens
        with self._lock:
            while True:
                others = [s for s in self._sessions.values() if s is not session]
                over_rows = sum(s.reserved_rows for s in others) + rows > budget_rows
                used_bytes = sum(s.reserved_bytes for s in others) + need_bytes
                over_bytes = budget_bytes is not None and used_bytes > budget_bytes
                if not (over_rows or over_bytes):
                    break
                if not self._evict_one_locked(session):
                    self.refusals += 1
                    limit = f"{budget_rows} tokens" + (f" / {budget_bytes} bytes" if budget_bytes is not None else "")
                    raise CapacityError(
                        f"the server's KV budget of {limit} is in use (this step needs {rows} rows, "
                        f"{need_bytes} bytes); retry later or on another replica."
                    )
            session.reserved_rows, session.reserved_bytes, session.reserved_pending = rows, need_bytes, pending

    def _evict_one_locked(self, keep: CloudSession | None) -> bool:
        """Drop the least recently used idle session other than `keep`; False if none may go. Hold the lock."""
        now = self.clock()
        idle = [
            s for s in self._sessions.values()
            if s is not keep and s.busy == 0 and not s.lock.locked() and now - s.last_used >= self.config.evict_idle_s
        ]
        if not idle:
            return False
        victim = min(idle, key=lambda s: s.last_used)
        del self._sessions[victim.id]
        victim.cache.release()  # the connection may still hold the session object; free its memory now
        self.evictions += 1
        log.info("evicted idle session %s... (%d KV rows) to make room", victim.id[:6], victim.reserved_rows)
        return True

    def claim(self, session: CloudSession) -> None:
        """Mark a step of `session` as queued: it cannot be evicted until `release`."""
        with self._lock:
            session.busy += 1

    def release(self, session: CloudSession) -> None:
        with self._lock:
            session.busy -= 1
            if session.busy == 0 and self._sessions.get(session.id) is not session:
                _free(session)  # closed or expired while its step ran: `close` had to leave its buffers

    def stats(self) -> dict:
        """Numbers for a metrics exporter: sessions, KV rows and bytes against their budgets, evictions."""
        with self._lock:
            sessions = list(self._sessions.values())
            evictions, refusals, skipped = self.evictions, self.refusals, self.skipped
        return {
            "sessions": len(sessions),
            "kv_tokens": sum(s.rows for s in sessions),
            "kv_committed_tokens": sum(s.cache.length for s in sessions),
            "kv_pending_tokens": sum(s.cache.held_rows + s.cache.pending for s in sessions),
            "kv_reserved_pending_tokens": sum(s.reserved_pending for s in sessions),
            "kv_reserved_tokens": sum(s.reserved_rows for s in sessions),
            "kv_reserved_bytes": sum(s.reserved_bytes for s in sessions),
            "kv_allocated_bytes": sum(s.cache.nbytes() for s in sessions),
            "kv_budget_tokens": self.config.max_cached_tokens,
            "kv_budget_bytes": self.config.max_kv_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "evictions": evictions,
            "refusals": refusals,
            "skipped_steps": skipped,
        }

    # -- steps -------------------------------------------------------------------------------------------
    def run_steps(self, items: Sequence[tuple[CloudSession, Step, float]]) -> list[Result | SplitInferError]:
        """Validate each (session, step, received_at), apply its lazy commit, and run all valid blocks through
        the middle layers in one batched pass. Returns a Result or the error for each item, in order: one
        session's bad step never fails another's. Call from the one compute thread."""
        outcomes: list[Result | SplitInferError | None] = [None] * len(items)
        held: list[CloudSession] = []
        ready: list[int] = []
        blocks: list[Block] = []
        depths: list[int] = []  # head depth of each block's session: one forward pass per depth
        try:
            for i, (session, step, _) in enumerate(items):
                if any(s is session for s in held):
                    outcomes[i] = ProtocolError("a session has one step in flight at a time; wait for each reply.")
                    continue
                session.lock.acquire()
                held.append(session)
                try:
                    with self._lock:
                        alive = self._sessions.get(session.id) is session
                    if not alive:
                        raise SessionError("the session was evicted or closed on this server; re-prefill.")
                    prefix = self._apply_step(session, step)
                except SplitInferError as exc:
                    outcomes[i] = exc
                    continue
                hidden = step.hidden.to(self._device, self._dtype)  # [q, d]
                positions = torch.tensor(step.positions, dtype=torch.long, device=self._device)
                allowed = step.structure.allowed(len(step.positions))
                blocks.append(Block(hidden, positions, allowed, session.cache, prefix))
                ready.append(i)
                depths.append(session.head_layers)
            start = time.perf_counter()
            outs: list[torch.Tensor | None] = [None] * len(blocks)
            for k in sorted(set(depths)):  # sessions that start at different layers run different stacks
                same = [j for j, d in enumerate(depths) if d == k]
                for j, out in zip(same, self.passes.run(k, [blocks[j] for j in same])):
                    outs[j] = out
            if outs and outs[0].device.type == "cuda":
                torch.cuda.synchronize(outs[0].device)
            compute_ms = (time.perf_counter() - start) * 1e3  # the whole batch's pass, shared by its steps
            for i, out in zip(ready, outs):
                session, step, received_at = items[i]
                session.cache.hold()  # pending until a later step resolves or drops it
                assumed = step.assume[step.resolved :]  # the first `resolved` were committed by the step
                session.pending = (*session.pending, PendingBlock(step.seq, step.positions, assumed))
                session.next_seq += 1
                session.last_used = self.clock()
                outcomes[i] = Result(
                    seq=step.seq,
                    hidden=out,
                    compute_ms=compute_ms,
                    handle_ms=(time.perf_counter() - received_at) * 1e3,
                    committed=session.cache.length,
                    wire_dtype=session.wire_dtype,
                    pad_quantum=step.pad_quantum,  # padding is never a row: nothing above ran for it
                )
        finally:
            for session in held:
                session.lock.release()
        return outcomes

    def skip_step(self, session: CloudSession, step: Step, received_at: float) -> Result | SplitInferError:
        """A step whose block the client already dropped: checked, its keep list and resolutions applied, the
        block itself never run nor held. Returns its reply (`skipped`, no rows) or its error. Call from the
        compute thread, like run_steps."""
        with session.lock:
            try:
                with self._lock:
                    if self._sessions.get(session.id) is not session:
                        raise SessionError("the session was evicted or closed on this server; re-prefill.")
                self._apply_step(session, step, skip=True)
            except SplitInferError as exc:
                return exc
            session.next_seq += 1
            session.last_used = self.clock()
            self.skipped += 1
            return Result(
                seq=step.seq, hidden=step.hidden[:0], compute_ms=0.0,
                handle_ms=(time.perf_counter() - received_at) * 1e3, committed=session.cache.length,
                wire_dtype=session.wire_dtype, skipped=True, pad_quantum=step.pad_quantum,
            )

    def run_step(self, session: CloudSession, step: Step, received_at: float) -> Result:
        """One step alone (the in-process middle, tests); raises its error."""
        outcome = self.run_steps([(session, step, received_at)])[0]
        if isinstance(outcome, SplitInferError):
            raise outcome
        return outcome


def _free(session: CloudSession) -> None:
    """Release a dropped session's KV buffers now, not when the last stray reference to it goes (a
    finished batch, a frame): user activations must not outlive their session. A session with a step
    queued or running keeps them; that step fails on the missing session or finishes first."""
    if session.busy == 0 and session.lock.acquire(blocking=False):
        try:
            session.cache.release()
        finally:
            session.lock.release()
