"""Cloud sessions: per-session KV cache of the middle layers, TTL, capacity budget, step execution.

This module holds the cloud's state machine and is free of I/O: the server adapter calls `open`,
`run_step` (on a worker thread) and `expire`. A session outlives its connection, so a client whose link
dropped can resume it; one that expired or was lost in a restart is rebuilt by the client (re-prefill).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..errors import CapacityError, ProtocolError, SessionError, ShardMismatch, VersionMismatch
from ..kv import KVCache
from ..model.shards import CloudHalf
from ..wire.messages import PROTOCOL_VERSION, Hello, Result, Step, Welcome

log = logging.getLogger("splitinfer.cloud")


@dataclass(frozen=True)
class SessionConfig:
    ttl_s: float = 300.0  # idle time after which a session and its cache are dropped
    max_sessions: int = 64  # open sessions at once; more get a retry-later error
    max_cached_tokens: int = 262_144  # KV rows over all sessions (committed + pending); the memory budget
    max_block_rows: int = 1024  # rows per step; also bounds prefill chunks
    max_message_bytes: int = 16 * 1024 * 1024  # WebSocket message limit, announced to clients

    def __post_init__(self):
        if self.ttl_s <= 0 or self.max_sessions < 1 or self.max_cached_tokens < 1 or self.max_block_rows < 1:
            raise ValueError("session TTL, max sessions, cached-token budget and block rows must all be positive.")


@dataclass
class CloudSession:
    id: str
    cache: KVCache
    wire_dtype: str
    last_used: float
    next_seq: int = 0
    pending_positions: tuple[int, ...] = ()
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def rows(self) -> int:
        return self.cache.length + self.cache.pending


class SessionTable:
    """All sessions of one server, over one CloudHalf. Thread-safe."""

    def __init__(self, half: CloudHalf, config: SessionConfig, clock: Callable[[], float] = time.monotonic):
        self.half = half
        self.config = config
        self.clock = clock
        self.max_position = int(getattr(half.config, "max_position_embeddings", 1 << 20))
        self._sessions: dict[str, CloudSession] = {}
        self._lock = threading.Lock()
        device = next(half.stack.parameters()).device
        self._device = device
        self._dtype = next(half.stack.parameters()).dtype

    def __len__(self) -> int:
        return len(self._sessions)

    def cached_tokens(self) -> int:
        with self._lock:
            return sum(s.rows for s in self._sessions.values())

    def open(self, hello: Hello) -> tuple[CloudSession, Welcome]:
        if hello.version != PROTOCOL_VERSION:
            raise VersionMismatch(
                f"client speaks protocol v{hello.version}, this server v{PROTOCOL_VERSION}; upgrade the older side."
            )
        stack = self.half.stack
        if hello.fingerprint != self.half.fingerprint or tuple(hello.cloud_layers) != (stack.start, stack.end):
            raise ShardMismatch(
                f"this server holds layers [{stack.start}, {stack.end}) with shard fingerprint "
                f"{self.half.fingerprint[:12]}..., but the client expects layers {list(hello.cloud_layers)} with "
                f"{hello.fingerprint[:12]}...; serve the cloud shard prepared together with the client's local shard."
            )
        now = self.clock()
        with self._lock:
            if hello.session_id is not None and hello.session_id in self._sessions:
                session = self._sessions[hello.session_id]
                if session.wire_dtype != hello.wire_dtype:
                    raise ProtocolError("a session cannot change its wire dtype on resume; open a new session.")
                session.last_used = now
                resumed = True
            else:
                if len(self._sessions) >= self.config.max_sessions:
                    raise CapacityError(
                        f"the server is at its limit of {self.config.max_sessions} sessions; retry later."
                    )
                session = CloudSession(
                    id=secrets.token_urlsafe(18), cache=stack.new_cache(), wire_dtype=hello.wire_dtype, last_used=now
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
        )
        return session, welcome

    def get(self, session_id: str) -> CloudSession:
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None:
            raise SessionError("the session is unknown to this server (expired or lost in a restart); re-prefill.")
        return session

    def close(self, session_id: str) -> None:
        with self._lock:
            self._sessions.pop(session_id, None)

    def expire(self) -> list[str]:
        """Drop sessions idle for longer than the TTL; returns their ids."""
        deadline = self.clock() - self.config.ttl_s
        with self._lock:
            gone = [sid for sid, s in self._sessions.items() if s.last_used < deadline and not s.lock.locked()]
            for sid in gone:
                del self._sessions[sid]
        if gone:
            log.info("expired %d idle session(s)", len(gone))
        return gone

    def _check_step(self, session: CloudSession, step: Step) -> None:
        cache = session.cache
        if step.seq != session.next_seq:
            raise ProtocolError(f"step seq {step.seq} is out of order; the session expects {session.next_seq}.")
        if step.wire_dtype != session.wire_dtype:
            raise ProtocolError(f"step tensor is {step.wire_dtype}, but the session uses {session.wire_dtype}.")
        if any(r >= cache.pending for r in step.keep):
            raise ProtocolError(f"keep names rows beyond the previous block of {cache.pending} rows.")
        for j, row in enumerate(step.keep):
            if session.pending_positions[row] != cache.length + j:
                raise ProtocolError("kept rows must form a contiguous path that continues the committed sequence.")
        committed = cache.length + len(step.keep)
        q = len(step.positions)
        depths = step.structure.depths(q)
        if depths is not None:
            expected = [committed + d for d in depths]
            if list(step.positions) != expected:
                raise ProtocolError(f"block positions must be the committed length ({committed}) plus each row's depth.")
        elif not all(committed <= p < committed + q for p in step.positions):
            raise ProtocolError(f"matrix block positions must lie in [{committed}, {committed + q}).")
        if max(step.positions) >= self.max_position:
            raise ProtocolError(f"position {max(step.positions)} exceeds the model's context of {self.max_position} tokens.")
        # The budget counts every session's rows; pending rows of this session are about to be replaced.
        others = self.cached_tokens() - session.rows
        if others + committed + q > self.config.max_cached_tokens:
            raise CapacityError(
                f"the server's KV budget of {self.config.max_cached_tokens} tokens is in use; retry later."
            )

    def run_step(self, session: CloudSession, step: Step, received_at: float) -> Result:
        """Validate, apply the lazy commit, run the middle layers. Call from a worker thread."""
        with session.lock:
            self._check_step(session, step)
            session.cache.keep(step.keep)
            start = time.perf_counter()
            hidden = step.hidden.to(self._device, self._dtype)[None]  # [1, q, d]
            positions = torch.tensor(step.positions, dtype=torch.long, device=self._device)
            allowed = step.structure.allowed(len(step.positions))
            out = self.half.stack(hidden, positions, allowed, session.cache)[0]
            if out.device.type == "cuda":
                torch.cuda.synchronize(out.device)
            compute_ms = (time.perf_counter() - start) * 1e3
            session.pending_positions = step.positions
            session.next_seq += 1
            session.last_used = self.clock()
            return Result(
                seq=step.seq,
                hidden=out,
                compute_ms=compute_ms,
                handle_ms=(time.perf_counter() - received_at) * 1e3,
                committed=session.cache.length,
                wire_dtype=session.wire_dtype,
            )
