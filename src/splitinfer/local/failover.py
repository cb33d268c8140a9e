"""Clients that know several servers: which one a session uses, and moving on when that one is gone.

Each session has a key (random per session unless given). `rendezvous_order` ranks the servers for a key
by highest random weight (rendezvous hashing): every client computes the same order for the same key
with no coordination, a session always starts on its first server and its resume reaches that server
again, and removing one server moves only that server's sessions (each to its own next one in the order).

`FailoverMiddle` is wire/transport.py's `Middle` over an ordered list of servers. It talks to one server
at a time; when opening or resuming a session there fails because the server is gone (connection refused
or lost: TransportError) or full (CapacityError), it opens a fresh session on the next server in the
order. The link (wire/link.py) sees a fresh welcome where it asked for a resume and re-sends the
committed history, so the output is the one the first server would have given. A server that lost only
the session (TTL, eviction) is not left: the link re-prefills there, as with one server.

This module moves no bytes itself (each server is a RemoteMiddle, local/middle.py) and knows nothing
about how the servers are deployed (plain `serve` processes, or the replicas of `serve --ray`).
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections.abc import Callable, Sequence

from ..errors import CapacityError, ConfigError, TransportError
from ..wire.messages import Result, Step, Welcome
from ..wire.transport import StepIO

log = logging.getLogger("splitinfer.local")


def rendezvous_order(key: str, servers: Sequence[str]) -> list[str]:
    """`servers` ranked for `key`, best first: by sha256(key, server), highest first (ties by name)."""

    def weight(server: str) -> bytes:
        return hashlib.sha256(f"{key}\x00{server}".encode()).digest()

    return sorted(servers, key=lambda s: (weight(s), s), reverse=True)


def server_list(servers: str | Sequence[str] | None) -> list[str]:
    """The servers named by `--server` (one URL, or several), without repeats; ConfigError when none."""
    urls = [servers] if isinstance(servers, str) else list(servers or ())
    unique = list(dict.fromkeys(u.strip() for u in urls if u and u.strip()))
    if not unique:
        raise ConfigError("give at least one --server ws://HOST:PORT (repeat --server for several servers).")
    return unique


class FailoverMiddle:
    """One session's transport over several servers, in rendezvous order for its key."""

    def __init__(self, servers: Sequence[str], make: Callable[[str], object], head_layers: int | None = None,
                 key: str | None = None):
        self.key = key if key is not None else secrets.token_urlsafe(12)  # random: sessions spread evenly
        self.order = rendezvous_order(self.key, server_list(servers))
        self.head_layers = head_layers  # the same k on every server: a session never changes its split
        self._make = make  # url -> a RemoteMiddle for that server, pinned to head_layers
        self._at = 0
        self._current = make(self.order[0])
        self.failovers = 0  # times this session moved to the next server

    @property
    def url(self) -> str:
        return self.order[self._at]

    @property
    def welcome(self) -> Welcome | None:
        return self._current.welcome

    def open(self, resume_id: str | None = None) -> Welcome:
        """Resume or open on the current server; when it is gone or full, open fresh on the next ones."""
        for tried in range(len(self.order)):
            try:
                return self._current.open(resume_id)
            except (TransportError, CapacityError) as exc:
                if tried == len(self.order) - 1:
                    raise  # every server failed once: the link backs off and asks again
                self._next(exc)
                resume_id = None  # a session id means nothing to another server
        raise AssertionError("unreachable")

    def _next(self, reason: Exception) -> None:
        gone = self.url
        self._current.close(end_session=False)
        self._at = (self._at + 1) % len(self.order)
        self._current = self._make(self.url)
        self.failovers += 1
        log.warning("server %s failed (%s); moving this session to %s", gone, reason, self.url)

    def step(self, step: Step) -> tuple[Result, StepIO]:
        return self._current.step(step)

    def close(self, end_session: bool = True) -> None:
        self._current.close(end_session)
