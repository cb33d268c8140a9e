"""Clients that know several servers: which one a session uses, and moving on when that one is gone.

Each session has a key (random per session unless given). `rendezvous_order` ranks the servers for a key
by highest random weight (rendezvous hashing): every client computes the same order for the same key
with no coordination, a session always starts on its first server and its resume reaches that server
again, and removing one server moves only that server's sessions (each to its own next one in the order).

`FailoverMiddle` is wire/transport.py's `Middle` over the servers of a `ReplicaSet`, the servers the
client was given plus those a server lists at GET /replicas (replicas that autoscaling added). It talks
to one server at a time; when opening or resuming a session there fails because the server is gone
(connection refused or lost: TransportError) or full (CapacityError), it re-reads the set and opens a
fresh session on the next server in the key's order. The link (wire/clientlink.py) sees a fresh welcome where
it asked for a resume and re-sends the committed history, so the output is the one the first server
would have given. A server that closes the link because it is draining (SIGTERM, errors.Draining) is not
asked again: the next open goes straight to the next server, with no backoff. A server that lost only
the session (TTL, eviction) is not left: the link re-prefills there, as with one server.

This module moves no session bytes itself (each server is a RemoteMiddle, local/middle.py) and knows
nothing about how the servers are deployed (plain `serve` processes, or the replicas of `serve --ray`).
A listing is trusted as far as the server that sent it: the client sends its token and its activations
to the servers listed, so a wss:// server may list only wss:// servers (whose certificates are checked).
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import threading
import time
from collections.abc import Callable, Collection, Sequence

from ..errors import CapacityError, ConfigError, Draining, TransportError
from ..wire.messages import Result, Step, Welcome
from ..wire.transport import StepIO

log = logging.getLogger("splitinfer.local")


def rendezvous_order(key: str, servers: Sequence[str]) -> list[str]:
    """`servers` ranked for `key`, best first: by sha256(key, server), highest first (ties by name)."""

    def weight(server: str) -> bytes:
        return hashlib.sha256(f"{key}\x00{server}".encode()).digest()

    return sorted(servers, key=lambda s: (weight(s), s), reverse=True)


class ReplicaSet:
    """The servers of one deployment as one client knows them: those it was given, plus those a server lists
    at GET /replicas (replicas added by autoscaling). Shared by the client's sessions; thread-safe.

    The listing is re-read at most every `refresh_s` when a session starts, and at once when a session's
    server fails. A listing adds to the given servers and replaces the previous listing, so a replica that
    left drops out while the servers the user named stay. New sessions rank the whole set; a session keeps
    its server for as long as it serves, so its KV cache is never abandoned for a newcomer.
    """

    def __init__(self, servers: str | Sequence[str], fetch: Callable[[str], list[str] | None] | None = None,
                 refresh_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.given = server_list(servers)
        self._listed: list[str] = []
        self._fetch = fetch  # url -> that server's listing, or None where it has none (or cannot be reached)
        self.refresh_s = refresh_s
        self._clock = clock
        self._checked: float | None = None
        self._lock = threading.Lock()

    def current(self) -> list[str]:
        """The set, re-read first when the last reading is older than `refresh_s` (by one caller: sessions
        starting meanwhile use the set as it is instead of asking the servers again)."""
        with self._lock:
            stale = self._checked is None or self._clock() - self._checked >= self.refresh_s
            due = self._fetch is not None and stale
            if due:
                self._checked = self._clock()
            else:
                return self._union()
        return self.refresh()

    def refresh(self, skip: Collection[str] = ()) -> list[str]:
        """Ask the known servers (not those in `skip`) in turn for their listing; the first answer wins."""
        with self._lock:
            known = self._union()
        listed = None
        if self._fetch is not None:
            for url in (u for u in known if u not in skip):
                listed = self._fetch(url)
                if listed is not None:
                    break
        with self._lock:
            self._checked = self._clock()
            if listed is not None:
                self._listed = list(listed)
            return self._union()

    def _union(self) -> list[str]:
        return list(dict.fromkeys(self.given + self._listed))


def fetch_replicas(url: str, auth=None, timeout_s: float = 5.0, max_bytes: int = 1 << 20) -> list[str] | None:
    """GET /replicas of the server at `url` (cloud/server.py): its deployment's server URLs, or None when it
    lists none or cannot be reached. The answer is checked like any reply from the network: a JSON object
    with a list of at most 1024 ws:// or wss:// URLs, never a downgrade from wss:// to ws://."""
    import json
    import urllib.error
    import urllib.request
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    http_url = f"{'https' if parts.scheme == 'wss' else 'http'}://{parts.netloc}/replicas"
    request = urllib.request.Request(http_url, headers=auth.headers() if auth is not None else {})
    context = auth.ssl_context(url) if auth is not None else None
    try:
        with urllib.request.urlopen(request, timeout=timeout_s, context=context) as response:
            body = response.read(max_bytes + 1)
    except (urllib.error.URLError, OSError, ValueError) as exc:  # HTTPError (404, 401) is a URLError
        log.debug("%s lists no replicas: %s", url, exc)
        return None
    try:
        urls = json.loads(body)["replicas"] if len(body) <= max_bytes else None
    except (ValueError, KeyError, TypeError):
        urls = None
    schemes = ("wss://",) if parts.scheme == "wss" else ("ws://", "wss://")
    if not isinstance(urls, list) or len(urls) > 1024 or not all(
        isinstance(u, str) and len(u) < 2048 and u.startswith(schemes) for u in urls
    ):
        log.warning("%s answered /replicas with something other than a list of server URLs; ignored", url)
        return None
    return urls


def server_list(servers: str | Sequence[str] | None) -> list[str]:
    """The servers named by `--server` (one URL, or several), without repeats; ConfigError when none."""
    urls = [servers] if isinstance(servers, str) else list(servers or ())
    unique = list(dict.fromkeys(u.strip() for u in urls if u and u.strip()))
    if not unique:
        raise ConfigError("give at least one --server ws://HOST:PORT (repeat --server for several servers).")
    return unique


class FailoverMiddle:
    """One session's transport over a deployment's servers, in rendezvous order for its key."""

    # One block at a time: a move to another server re-sends the history, which blocks in flight would race.
    sends_ahead = False

    def __init__(self, servers: Sequence[str] | ReplicaSet, make: Callable[[str], object],
                 head_layers: int | None = None, key: str | None = None):
        self.replicas = servers if isinstance(servers, ReplicaSet) else ReplicaSet(servers)
        self.key = key if key is not None else secrets.token_urlsafe(12)  # random: sessions spread evenly
        self.order = rendezvous_order(self.key, self.replicas.current())
        self.head_layers = head_layers  # the same k on every server: a session never changes its split
        self._make = make  # url -> a RemoteMiddle for that server, pinned to head_layers
        self.url = self.order[0]  # the session's server; it stays while it serves, whatever joins the set
        self._current = make(self.url)
        self.failovers = 0  # times this session moved to another server
        self._drained: Draining | None = None  # the current server closed the link because it is shutting down

    @property
    def welcome(self) -> Welcome | None:
        return self._current.welcome

    def open(self, resume_id: str | None = None, version: int | None = None) -> Welcome:
        """Resume or open on the current server; when it is gone, full or draining, open fresh on the next one
        in the order over the set as it is now (re-read: an autoscaled replica may have joined, a dead one left)."""
        failed: set[str] = set()
        if self._drained is not None:  # it said it is going away: do not knock on it again
            reason, self._drained = self._drained, None
            if self._fail_over(failed, reason):
                resume_id = None
        while True:
            try:
                return self._current.open(resume_id, version)
            except (TransportError, CapacityError) as exc:
                if not self._fail_over(failed, exc):
                    raise  # every server failed once: the link backs off and asks again
                resume_id = None  # a session id means nothing to another server

    def _fail_over(self, failed: set[str], reason: Exception) -> bool:
        """Move to the first server of the order, as re-read, that has not failed; False when none is left."""
        failed.add(self.url)
        self.order = rendezvous_order(self.key, self.replicas.refresh(skip=failed))
        rest = [url for url in self.order if url not in failed]
        if rest:
            self._move(rest[0], reason)
        return bool(rest)

    def _move(self, url: str, reason: Exception) -> None:
        gone = self.url
        self._current.close(end_session=False)
        self.url = url
        self._current = self._make(url)
        self.failovers += 1
        level = logging.INFO if isinstance(reason, Draining) else logging.WARNING  # a drain is planned, not a fault
        log.log(level, "server %s failed (%s); moving this session to %s", gone, reason, url)

    def step(self, step: Step) -> tuple[Result, StepIO]:
        try:
            return self._current.step(step)
        except Draining as exc:
            self._drained = exc  # the next open goes straight to the next server
            raise

    def post(self, step: Step) -> None:
        self._current.post(step)

    def collect(self) -> tuple[Result, StepIO]:
        return self._current.collect()

    def cover(self, request_bytes: int, reply_bytes: int, hold_ms: float) -> None:
        self._current.cover(request_bytes, reply_bytes, hold_ms)  # on the session's server, as its steps go

    def close(self, end_session: bool = True) -> None:
        self._current.close(end_session)
