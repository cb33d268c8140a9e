"""What the client's link needs from a transport to the middle layers, as a typed Protocol.

A `Middle` carries one session's messages: `open` sends the hello and returns the welcome, `step` sends
one step and returns its result with the bytes and times it cost, `close` ends the session. A middle that
`sends_ahead` also carries blocks in flight (protocol v3): `post` sends a step without waiting and
`collect` takes the replies in order, and `open` names the protocol version the hello asks for; the session
calls none of the three on a middle that does not. `cover` sends a cover exchange (padding a reply's step
count, wire/cover.py). It moves and times messages only; which message goes
next is decided by the link (wire/clientlink.py). A WebSocket (local/middle.py), a set of servers with failover
(local/failover.py) and the in-process middle (inprocess.py) are the implementations.

Failures are errors.py's: SessionError when the server lost the session, TransportError when the link
failed (both make the link reconnect), anything else is raised to the caller.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .messages import Result, Step, Welcome


@dataclass
class StepIO:
    round_trip_ms: float  # request sent -> reply received (includes the server's handling)
    serialize_ms: float  # client-side encode + decode
    bytes_up: int
    bytes_down: int


class Middle(Protocol):
    # k pinned in every hello of this transport's session (split-point randomisation), resumes included;
    # None for the shard's fixed split.
    head_layers: int | None
    # True: `post`, `collect` and `open(version=...)` carry blocks in flight; False: one block at a time.
    sends_ahead: bool

    def open(self, resume_id: str | None = None, version: int | None = None) -> Welcome:
        """Send a hello (resuming `resume_id` when the server still has it; protocol `version`, None for the
        oldest that carries it) and return the welcome."""
        ...

    def step(self, step: Step) -> tuple[Result, StepIO]:
        """Send one step and return the server's result for it."""
        ...

    def post(self, step: Step) -> None:
        """Send a step without waiting for its reply (a block in flight)."""
        ...

    def collect(self) -> tuple[Result, StepIO]:
        """The reply to the oldest posted step."""
        ...

    def cover(self, request_bytes: int, reply_bytes: int, hold_ms: float) -> None:
        """Send a cover exchange (wire/cover.py: a probe whose request and reply have the given sizes, answered
        after `hold_ms`) and wait for its reply; a middle with no network between the halves does nothing."""
        ...

    def close(self, end_session: bool = True) -> None:
        """Free the server's session when `end_session` (best effort), then drop the connection."""
        ...
