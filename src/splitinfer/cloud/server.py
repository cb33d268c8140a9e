"""The cloud server: a WebSocket adapter over SessionTable. It only moves bytes and schedules work;
which message a peer may send when (hello first) is the link protocol's rule: each connection has a
wire/serverlink.py `ServerLink` over the table in wire/link.py.

Decoding and validation happen on the event loop (cheap); the middle layers run on one compute thread
(scheduler.py), which batches concurrent sessions' steps, so compute never stalls any connection's I/O.
A connection's messages are read as they arrive (inbox.py) and handled in order; a step that later steps,
already received, show its client dropped (blocks in flight) is applied without running its block.
permessage-deflate is off: float16 activations do not compress, and inflating small frames into huge
ones is a classic bomb; `max_size` bounds every message instead.

Authentication happens in the HTTP handshake (`_authorize`), before the WebSocket upgrade: a peer
without a valid bearer token gets HTTP 401 and never reaches the protocol. Sessions belong to the token
that opened them. A connection that keeps sending invalid messages is closed (1008) after
`max_errors_per_connection` of them; a message over `max_message_bytes` is closed by websockets (1009).

`GET /replicas` (same port, same token) answers `{"replicas": [URL, ...]}`: the servers of this deployment
that are up, as `replicas` reports them (the replicas of `serve --ray`, autoscaled ones included), so that
clients routing by rendezvous hashing learn them (local/failover.py). A server without a replica set
answers 404.

SIGTERM drains (`drain`): the listening socket closes, each connection finishes the message it is handling
and sends its reply, then is closed with link.py's DRAINING_CLOSE, which clients take as "open the session
on another server now" (local/failover.py), not as a fault; the process exits once every connection ended.
"""

from __future__ import annotations

import asyncio
import http
import json
import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from ..errors import MessageTooLarge, SplitInferError
from .security import TokenSet, server_ssl_context
from ..model.shards import CloudHalf
from ..wire.link import DRAINING_CLOSE, PING_INTERVAL_S, PING_TIMEOUT_S
from ..wire.serverlink import ServerLink, dropped
from ..wire.messages import Close, Error, Hello, Limits, Probe, ProbeReply, Step, decode_client_message
from .batch import LocalPasses
from .inbox import Inbox
from .scheduler import BatchConfig, Scheduler
from .sessions import SessionConfig, SessionTable

log = logging.getLogger("splitinfer.cloud")

REPLICAS_PATH = "/replicas"


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # interface to listen on
    port: int = 8765  # 0 picks a free port
    sessions: SessionConfig = SessionConfig()
    sweep_interval_s: float = 5.0  # how often idle sessions are looked for
    batching: BatchConfig = BatchConfig()  # how concurrent sessions' steps are gathered into one pass
    tokens: TokenSet = TokenSet()  # accepted bearer tokens; empty = no authentication (loopback, --insecure)
    tls_cert: str | None = None  # PEM certificate chain; with tls_key, the server speaks wss://
    tls_key: str | None = None  # PEM private key of tls_cert
    client_ca: str | None = None  # PEM CA bundle; when set, clients must present a certificate it signed (mTLS)
    max_errors_per_connection: int = 16  # invalid messages tolerated on one connection before it is closed
    drain_timeout_s: float = 30.0  # on SIGTERM, how long steps in progress may take before the server exits anyway

    @property
    def scheme(self) -> str:
        return "wss" if self.tls_cert else "ws"


class CloudServer:
    def __init__(self, half: CloudHalf, config: ServerConfig = ServerConfig(), passes: LocalPasses | None = None):
        self.half = half
        self.config = config
        # `passes`: where the middle runs (this process, or every rank of a tensor-parallel group).
        self.table = SessionTable(half, config.sessions, passes=passes)
        self.limits = Limits(
            hidden_size=half.config.hidden_size, max_block_rows=config.sessions.max_block_rows
        )
        # One compute thread batches the steps of concurrent sessions and encodes their replies.
        self.scheduler = Scheduler(self.table, config.batching, finish=lambda result: result.encode())
        self._server = None
        self.port: int | None = None
        self.metrics = None  # a metrics.CloudMetrics (`serve --metrics-port`); None records nothing
        self.replicas: Callable[[], list[str]] | None = None  # this deployment's live server URLs, for GET /replicas
        self.draining = False  # set by `drain`: no new connections; each open one ends after its step in progress
        self._busy: set[ServerConnection] = set()  # connections handling a message (its reply not sent yet)

    def _authorize(self, connection: ServerConnection, request):
        """websockets' process_request hook: refuse a missing or wrong token before the upgrade; answer
        GET /replicas (after the same token check) without upgrading."""
        if self.config.tokens.identify(request.headers.get("Authorization")) is not None:
            return self._replicas_response(connection) if request.path == REPLICAS_PATH else None
        log.info("refused a connection from %s: missing or invalid bearer token", connection.remote_address)
        response = connection.respond(http.HTTPStatus.UNAUTHORIZED, "missing or invalid bearer token\n")
        response.headers["WWW-Authenticate"] = 'Bearer realm="splitinfer"'
        if self.metrics is not None:
            self.metrics.error("auth")
        return response

    def _replicas_response(self, connection: ServerConnection):
        if self.replicas is None:
            return connection.respond(http.HTTPStatus.NOT_FOUND, "this server lists no replicas\n")
        response = connection.respond(http.HTTPStatus.OK, json.dumps({"replicas": list(self.replicas())}))
        del response.headers["Content-Type"]
        response.headers["Content-Type"] = "application/json"
        return response

    async def _handle(self, ws: ServerConnection) -> None:
        owner = self.config.tokens.identify(ws.request.headers.get("Authorization"))
        link = ServerLink(self.config.max_errors_per_connection)
        try:
            async with Inbox(ws, self.limits, self.config.sessions.max_in_flight + 2) as inbox:
                await self._serve_messages(ws, inbox, link, owner)
        except ConnectionClosed:
            pass  # the session stays until its TTL, so the client can resume it
        except Exception:  # noqa: BLE001 - the server must keep serving everyone else
            log.exception("unexpected failure on a connection from %s", ws.remote_address)
            await ws.close(code=1011, reason="internal error")

    async def _serve_messages(self, ws: ServerConnection, inbox: Inbox, link: ServerLink, owner: str) -> None:
        """A connection's messages in order: each one's reply goes out before the next message is taken. Once
        the server drains, the connection is closed with DRAINING_CLOSE after the message in progress."""
        while not self.draining and (data := await inbox.next()) is not None and not self.draining:
            self._busy.add(ws)
            try:
                if not await self._serve_message(ws, inbox, link, owner, data):
                    return
            finally:
                self._busy.discard(ws)
        if self.draining:
            await ws.close(code=DRAINING_CLOSE, reason="server draining; open the session on another server")

    async def _serve_message(self, ws: ServerConnection, inbox: Inbox, link: ServerLink, owner: str, data) -> bool:
        """Act on one message and answer it; False when the connection is to end. A step that later steps,
        already received, show its client dropped is applied but not run (`dropped`)."""
        received_at = time.perf_counter()
        seq = None
        try:
            message = decode_client_message(data, self.limits)
            seq = message.seq if isinstance(message, (Step, Probe)) else None
            link.check(message)  # hello first (wire/serverlink.py)
            opened = None
            if isinstance(message, Hello):
                session, welcome = self.table.open(message, owner=owner)
                opened = session.id
                await ws.send(welcome.encode())
            elif isinstance(message, Step):
                session = self.table.get(link.session_id, owner)  # raises if it expired meanwhile
                skip = dropped(message, inbox.later_steps())
                reply = await self.scheduler.run(session, message, received_at, skip)
                if message.hold_ms:  # the client pads its steps' timing (T6): no reply before the hold is over
                    await asyncio.sleep(max(received_at + message.hold_ms / 1e3 - time.perf_counter(), 0.0))
                if self.metrics is not None:
                    self.metrics.observe_step(len(message.positions), len(data), len(reply), time.perf_counter() - received_at)
                await ws.send(reply)
            elif isinstance(message, Probe):
                reply = self._probe_reply(message)
                if message.hold_ms:  # a cover exchange stands in for a step's pass (wire/cover.py); others keep being served
                    await asyncio.sleep(message.hold_ms / 1e3)
                await ws.send(reply)
            elif isinstance(message, Close):
                if link.session_id is not None:
                    self.table.close(link.session_id)
                    self.scheduler.forget(link.session_id)  # no pass waits for its steps any more
                link.moved(message)
                await ws.close()
                return False
            link.moved(message, opened)
        except SplitInferError as exc:
            log.info("error for %s: %s: %s", ws.remote_address, exc.code, exc)
            if self.metrics is not None:
                self.metrics.error(exc.code)
            await ws.send(Error.from_exception(exc, seq).encode())
            if link.refused(exc):  # protocol errors only: capacity or expiry is not the peer's fault
                await ws.close(code=1008, reason="too many invalid messages")
                return False
        return True

    def _probe_reply(self, probe: Probe) -> bytes:
        # Path measurement (`splitinfer bench probe`): no session, no compute; the reply obeys the message limit,
        # checked before allocating it (a peer may ask for up to MAX_PROBE_BYTES).
        limit = self.config.sessions.max_message_bytes
        reply = b""
        if probe.reply_bytes < limit:
            reply = ProbeReply(probe.seq, len(probe.payload), bytes(probe.reply_bytes)).encode()
        if not reply or len(reply) > limit:
            raise MessageTooLarge(
                f"a probe asked for {probe.reply_bytes} reply bytes; this server's message limit is {limit} bytes "
                "(header included), so ask for fewer reply bytes."
            )
        return reply

    def _ssl_context(self):
        if not self.config.tls_cert:
            return None
        return server_ssl_context(self.config.tls_cert, self.config.tls_key or self.config.tls_cert, self.config.client_ca)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            self.table.expire()

    async def start(self) -> None:
        self._server = await serve(
            self._handle,
            self.config.host,
            self.config.port,
            compression=None,
            max_size=self.config.sessions.max_message_bytes,
            process_request=self._authorize,
            ssl=self._ssl_context(),
            ping_interval=PING_INTERVAL_S,
            ping_timeout=PING_TIMEOUT_S,
        )
        self.port = self._server.sockets[0].getsockname()[1] if self._server.sockets else self.config.port
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        stack, (low, high) = self.half.stack, self.half.head_range
        log.info(
            "serving layers [%d, %d) of %s%s on %s://%s:%d (%s)",
            stack.start, stack.end, self.half.manifest["model_id"],
            f" (sessions pick their split in {low}..{high})" if high > low else "",
            self.config.scheme, self.config.host, self.port,
            f"{len(self.config.tokens.digests)} token(s)" if self.config.tokens.enabled else "no authentication",
        )

    async def drain(self) -> None:
        """Graceful shutdown (SIGTERM): refuse new connections, let every step in progress finish and its reply
        go out, then close each connection with DRAINING_CLOSE, which its client takes as "move to another
        server now" (no backoff). Returns when every connection has ended, or after `drain_timeout_s`."""
        if self._server is None:
            return
        self.draining = True
        self._server.close(close_connections=False)  # stop listening; handshakes under way get HTTP 503
        idle = [ws for ws in self._server.connections if ws not in self._busy]
        log.info("draining: %d connection(s), %d with a step in progress", len(idle) + len(self._busy), len(self._busy))
        for ws in idle:  # waiting for their next message; the busy ones close themselves after their reply
            asyncio.get_running_loop().create_task(ws.close(code=DRAINING_CLOSE, reason="server draining"))
        try:
            await asyncio.wait_for(self._server.wait_closed(), self.config.drain_timeout_s)
        except TimeoutError:
            log.warning("draining: connections still open after %.0f s; stopping anyway", self.config.drain_timeout_s)

    async def stop(self) -> None:
        if self._server is not None:
            self._sweeper.cancel()
            self._server.close()
            for ws in self._server.connections:  # left by a drain cut short (else it closed them already)
                asyncio.get_running_loop().create_task(ws.close(code=1001, reason="server stopping"))
            await self._server.wait_closed()
            self._server = None
        self.scheduler.close()

    async def serve_forever(self) -> None:
        """Serve until SIGTERM or SIGINT, then drain (a second signal skips the wait) and stop."""
        await self.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        stop.clear()
        drain = loop.create_task(self.drain())
        await asyncio.wait([drain, loop.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        await self.stop()


class ServerThread:
    """A CloudServer on its own event loop in a daemon thread (tests, benchmarks, local-only tools)."""

    def __init__(self, half: CloudHalf, config: ServerConfig = ServerConfig(port=0), passes: LocalPasses | None = None):
        self.server = CloudServer(half, config, passes)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="splitinfer-server", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self._loop).result(timeout=30)

    @property
    def url(self) -> str:
        return f"{self.server.config.scheme}://{self.server.config.host}:{self.server.port}"

    def drain(self, timeout_s: float = 60.0) -> None:
        """CloudServer.drain, as SIGTERM runs it: returns once every connection has ended."""
        asyncio.run_coroutine_threadsafe(self.server.drain(), self._loop).result(timeout=timeout_s)

    def close(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self.server.stop(), self._loop).result(timeout=30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
