"""The WebSocket transport to a `splitinfer serve` process: it moves the link's messages and times them.

`RemoteMiddle` implements wire/transport.py's `Middle` (`open(resume_id) -> Welcome`,
`step(Step) -> (Result, StepIO)`, `close()`, `cover`) and `probe` for path measurement. For blocks in flight it
also sends a step without waiting for its reply (`post`) and takes replies in the order the steps went
(`collect`): the server answers one connection's steps in order. It decodes everything
the server returns as strictly as the server decodes requests (an untrusted server must not be able to
crash or confuse the client) and raises errors from errors.py: `SessionError` when the server lost the
session, `TransportError` when the connection failed (`Draining` when the server closed it because it is
shutting down gracefully). Whether a reply fits the session (its seq, its rows,
the committed length) is the link's rule (wire/clientlink.py), not this module's. The in-process middle, which
needs the cloud's session table, lives above both local/ and cloud/ (inprocess.py).
"""

from __future__ import annotations

import ssl
import time
from collections import deque
from contextlib import contextmanager

from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI
from websockets.sync.client import ClientConnection, connect

from ..errors import AuthError, Draining, ProtocolError, TransportError, error_from_code
from ..wire.messages import (
    Close, Error, Hello, Limits, Probe, ProbeReply, Result, Step, Welcome, decode_server_message,
)
from ..wire.cover import cover_probe
from ..wire.frame import DEFAULT_WIRE_DTYPE
from ..wire.link import DRAINING_CLOSE, PING_INTERVAL_S, PING_TIMEOUT_S
from ..wire.transport import StepIO
from .auth import ClientAuth

__all__ = ["RemoteMiddle", "StepIO"]


class RemoteMiddle:
    """A synchronous WebSocket connection to a `splitinfer serve` process."""

    sends_ahead = True  # post/collect carry blocks in flight over the one WebSocket

    def __init__(
        self,
        url: str,
        fingerprint: str,
        cloud_layers: tuple[int, int],
        hidden_size: int,
        wire_dtype: str = DEFAULT_WIRE_DTYPE,
        open_timeout_s: float = 10.0,
        reply_timeout_s: float = 120.0,
        max_message_bytes: int = 64 * 1024 * 1024,
        auth: ClientAuth = ClientAuth(),
        head_layers: int | None = None,
    ):
        self.url = url
        self.head_layers = head_layers  # k pinned in every hello of this session (resume included); None: fixed split
        self.fingerprint = fingerprint
        self.cloud_layers = cloud_layers
        self.wire_dtype = wire_dtype
        self.open_timeout_s = open_timeout_s
        self.reply_timeout_s = reply_timeout_s
        self.max_message_bytes = max_message_bytes
        self.auth = auth
        self.limits = Limits(hidden_size=hidden_size, max_block_rows=1 << 16, dtypes=(wire_dtype,))
        self.welcome: Welcome | None = None
        self._ws: ClientConnection | None = None
        self._probe_seq = 0
        self._posted: deque[tuple[float, float, int]] = deque()  # (sent at, encode ms, bytes) of posted steps
        # A list to record (direction "up"/"down", perf_counter time, bytes) of every message (a request as it
        # starts to leave, a reply once in): what a network observer with TLS intact sees, for the metadata
        # audit (privacy/metadata.py, threat T6). None: off.
        self.tap: list[tuple[str, float, int]] | None = None

    @classmethod
    def for_shard(cls, url: str, manifest: dict, hidden_size: int, wire_dtype: str = DEFAULT_WIRE_DTYPE,
                  auth: ClientAuth = ClientAuth(), head_layers: int | None = None) -> "RemoteMiddle":
        """The middle that a shard's `manifest` (local or cloud: both name the cloud shard and the split) pins:
        the one way to build a RemoteMiddle that runs steps."""
        cloud_layers = tuple(manifest["split"]["cloud_layers"])
        return cls(url, manifest["cloud_fingerprint"], cloud_layers, hidden_size, wire_dtype, auth=auth,
                   head_layers=head_layers)

    @classmethod
    def prober(cls, url: str, auth: ClientAuth = ClientAuth()) -> "RemoteMiddle":
        """A middle that only sends probes (`probe`): it needs no shard and opens no session."""
        return cls(url, "-", (0, 0), hidden_size=1, auth=auth)

    def _exchange(self, payload: bytes):
        reply = self._exchange_raw(payload)
        message = decode_server_message(reply, self.limits)
        if isinstance(message, Error):
            raise error_from_code(message.code, f"server: {message.message}")
        return message

    def open(self, resume_id: str | None = None, version: int | None = None) -> Welcome:
        """Send a hello (protocol `version`, default the oldest that carries it) and return the welcome."""
        self.connect()
        hello = Hello(
            self.fingerprint, self.cloud_layers, self.wire_dtype, session_id=resume_id, head_layers=self.head_layers,
            version=version,
        )
        welcome = self._exchange(hello.encode())
        if not isinstance(welcome, Welcome):
            raise ProtocolError("the server answered hello with something other than welcome.")
        self.welcome = welcome
        return welcome

    def connect(self) -> None:
        """Open the WebSocket (token, TLS) without a session: `open` and `probe` both start here."""
        self._drop()
        try:
            self._ws = connect(
                self.url,
                compression=None,
                max_size=self.max_message_bytes,
                open_timeout=self.open_timeout_s,
                ping_interval=PING_INTERVAL_S,
                ping_timeout=PING_TIMEOUT_S,
                additional_headers=self.auth.headers(),
                ssl=self.auth.ssl_context(self.url),
            )
        except InvalidStatus as exc:
            status = exc.response.status_code
            if status in (401, 403):
                raise AuthError(
                    f"the server at {self.url} refused the token; check --token-file (or SPLITINFER_TOKEN) against "
                    f"the server's token file (HTTP {status})."
                ) from exc
            raise TransportError(f"cannot connect to {self.url}: {exc}. Is `splitinfer serve` running there?") from exc
        except ssl.SSLCertVerificationError as exc:
            raise AuthError(
                f"the certificate of {self.url} is not trusted ({exc.verify_message}); pass the CA that signed it "
                "with --ca-file, and connect by the name or address the certificate was issued for."
            ) from exc
        except (OSError, TimeoutError, InvalidHandshake, InvalidURI, ConnectionClosed) as exc:
            # A server that requires client certificates may drop a client without one during or right
            # after the TLS handshake, so the failure can look like a plain closed connection.
            hint = "" if not self.url.startswith("wss://") or self.auth.client_cert else (
                " If it requires client certificates (serve --client-ca), pass --client-cert."
            )
            raise TransportError(
                f"cannot connect to {self.url}: {exc}. Is `splitinfer serve` running there?{hint}"
            ) from exc

    def step(self, step: Step) -> tuple[Result, StepIO]:
        t0 = time.perf_counter()
        payload = step.encode()
        t1 = time.perf_counter()
        self._check_size(payload)
        reply_view = self._exchange_raw(payload)
        t2 = time.perf_counter()
        message = self._result(reply_view)
        t3 = time.perf_counter()
        io = StepIO((t2 - t1) * 1e3, ((t1 - t0) + (t3 - t2)) * 1e3, len(payload), len(reply_view))
        return message, io

    def post(self, step: Step) -> None:
        """Send a step without waiting for its reply (a block in flight); `collect` takes the replies in order."""
        t0 = time.perf_counter()
        payload = step.encode()
        t1 = time.perf_counter()
        self._check_size(payload)
        if self._ws is None:
            raise TransportError("not connected")
        with self._link_errors():
            self._send(payload)
        self._posted.append((t1, (t1 - t0) * 1e3, len(payload)))

    def collect(self) -> tuple[Result, StepIO]:
        """The reply to the oldest posted step; its round trip runs from its post to now, so it includes the
        time its reply waited behind the replies to earlier steps."""
        sent_at, encode_ms, bytes_up = self._posted.popleft()
        if self._ws is None:
            raise TransportError("not connected")
        with self._link_errors():
            reply = self._recv()
        t2 = time.perf_counter()
        message = self._result(reply)
        t3 = time.perf_counter()
        return message, StepIO((t2 - sent_at) * 1e3, encode_ms + (t3 - t2) * 1e3, bytes_up, len(reply))

    def _check_size(self, payload: bytes) -> None:
        if self.welcome is not None and len(payload) > self.welcome.max_message_bytes:
            raise ProtocolError(
                f"a {len(payload)}-byte step exceeds the server's {self.welcome.max_message_bytes}-byte limit; "
                "send smaller blocks (a smaller prefill chunk)."
            )

    def _result(self, reply) -> Result:
        """The server's answer to a step, or the error it sent raised as what it means."""
        message = decode_server_message(reply, self.limits)
        if isinstance(message, Error):
            raise error_from_code(message.code, f"server: {message.message}")
        if not isinstance(message, Result):
            raise ProtocolError("the server's reply does not answer the step that was sent.")
        return message

    def probe(self, up: int, down: int) -> float:
        """Send `up` bytes, get `down` back, no session and no compute; returns the round trip in ms."""
        self._probe_seq += 1
        return self._probe(Probe(self._probe_seq, down, bytes(up)))

    def cover(self, request_bytes: int, reply_bytes: int, hold_ms: float) -> None:
        """A cover exchange: a probe whose request and reply frames have exactly these sizes (a padded step's),
        answered after `hold_ms` (wire/cover.py)."""
        self._probe_seq += 1
        self._probe(cover_probe(self._probe_seq, request_bytes, reply_bytes, hold_ms))

    def _probe(self, probe: Probe) -> float:
        if self._ws is None:
            self.connect()
        t0 = time.perf_counter()
        reply = self._exchange_raw(probe.encode())
        elapsed_ms = (time.perf_counter() - t0) * 1e3
        message = decode_server_message(reply, self.limits)
        if isinstance(message, Error):
            hint = " (this server predates probe messages)" if "unknown client message type" in message.message else ""
            raise error_from_code(message.code, f"server: {message.message}{hint}")
        if not isinstance(message, ProbeReply) or message.seq != probe.seq:
            raise ProtocolError("the server's reply does not answer the probe that was sent.")
        up, down = len(probe.payload), probe.reply_bytes
        if message.received != up or len(message.payload) != down:
            raise ProtocolError(f"probe sent {up} and asked for {down} bytes; the server got {message.received} "
                                f"and sent {len(message.payload)}.")
        return elapsed_ms

    def _exchange_raw(self, payload: bytes) -> bytes:
        if self._ws is None:
            raise TransportError("not connected")
        with self._link_errors():
            self._send(payload)
            return self._recv()

    def _send(self, payload: bytes) -> None:
        sent_at = time.perf_counter()  # as it starts to leave: a large message may arrive before send returns
        self._ws.send(payload)
        if self.tap is not None:
            self.tap.append(("up", sent_at, len(payload)))

    def _recv(self) -> bytes:
        reply = self._ws.recv(timeout=self.reply_timeout_s)
        if self.tap is not None:
            self.tap.append(("down", time.perf_counter(), len(reply)))
        return reply

    @contextmanager
    def _link_errors(self):
        """A timeout or a lost connection drops the socket and becomes a TransportError naming the server."""
        try:
            yield
        except TimeoutError as exc:
            self._drop()
            raise TransportError(f"no reply from {self.url} within {self.reply_timeout_s:g} s.") from exc
        except ConnectionClosed as exc:
            self._drop()
            if exc.rcvd is not None and exc.rcvd.code == DRAINING_CLOSE:
                raise Draining(f"{self.url} is shutting down and finished this session's last step there.") from exc
            raise TransportError(f"the connection to {self.url} was lost ({exc}).") from exc
        except OSError as exc:
            self._drop()
            raise TransportError(f"the connection to {self.url} was lost ({exc}).") from exc

    def _drop(self) -> None:
        self._posted.clear()  # their replies can never come on another connection
        if self._ws is not None:
            try:
                self._ws.close()
            except (OSError, ConnectionClosed):
                pass
            self._ws = None

    def __enter__(self) -> "RemoteMiddle":
        return self

    def __exit__(self, *exc) -> None:
        self.close(end_session=True)

    def close(self, end_session: bool = True) -> None:
        """Ask the server to free the session (best effort), then close the connection."""
        if self._ws is not None and end_session:
            try:
                self._send(Close().encode())
            except (OSError, ConnectionClosed):
                pass
        self._drop()

