"""Ways for the local client to reach the middle layers: over a WebSocket, or in this process.

Both expose `open(resume_id) -> Welcome`, `step(Step) -> (Result, StepIO)` and `close()`, and raise
errors from errors.py: `SessionError` when the server lost the session, `TransportError` when the link
failed. `RemoteMiddle` validates everything the server returns as strictly as the server validates
requests (an untrusted server must not be able to crash or confuse the client).
"""

from __future__ import annotations

import ssl
import time
from dataclasses import dataclass

from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI
from websockets.sync.client import ClientConnection, connect

from ..cloud.sessions import SessionConfig, SessionTable
from ..errors import AuthError, ProtocolError, TransportError, error_from_code
from ..model.shards import CloudHalf
from .auth import ClientAuth
from ..wire.messages import (
    Close, Error, Hello, Limits, Probe, ProbeReply, Result, Step, Welcome, decode_server_message,
)


@dataclass
class StepIO:
    round_trip_ms: float  # request sent -> reply received (includes the server's handling)
    serialize_ms: float  # client-side encode + decode
    bytes_up: int
    bytes_down: int


class RemoteMiddle:
    """A synchronous WebSocket connection to a `splitinfer serve` process."""

    def __init__(
        self,
        url: str,
        fingerprint: str,
        cloud_layers: tuple[int, int],
        hidden_size: int,
        wire_dtype: str = "float16",
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

    def _exchange(self, payload: bytes):
        reply = self._exchange_raw(payload)
        message = decode_server_message(reply, self.limits)
        if isinstance(message, Error):
            raise error_from_code(message.code, f"server: {message.message}")
        return message

    def open(self, resume_id: str | None = None) -> Welcome:
        self.connect()
        hello = Hello(
            self.fingerprint, self.cloud_layers, self.wire_dtype, session_id=resume_id, head_layers=self.head_layers
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
                ping_interval=20,
                ping_timeout=60,
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
        if self.welcome is not None and len(payload) > self.welcome.max_message_bytes:
            raise ProtocolError(
                f"a {len(payload)}-byte step exceeds the server's {self.welcome.max_message_bytes}-byte limit; "
                "use a smaller prefill chunk."
            )
        reply_view = self._exchange_raw(payload)
        t2 = time.perf_counter()
        message = decode_server_message(reply_view, self.limits)
        t3 = time.perf_counter()
        if isinstance(message, Error):
            raise error_from_code(message.code, f"server: {message.message}")
        if not isinstance(message, Result) or message.seq != step.seq:
            raise ProtocolError("the server's reply does not answer the step that was sent.")
        if message.hidden.shape[0] != step.hidden.shape[0]:
            raise ProtocolError(
                f"the server returned {message.hidden.shape[0]} rows for a {step.hidden.shape[0]}-row block."
            )
        io = StepIO((t2 - t1) * 1e3, ((t1 - t0) + (t3 - t2)) * 1e3, len(payload), len(reply_view))
        return message, io

    def probe(self, up: int, down: int) -> float:
        """Send `up` bytes, get `down` back, no session and no compute; returns the round trip in ms."""
        if self._ws is None:
            self.connect()
        self._probe_seq += 1
        payload = Probe(self._probe_seq, down, bytes(up)).encode()
        t0 = time.perf_counter()
        reply = self._exchange_raw(payload)
        elapsed_ms = (time.perf_counter() - t0) * 1e3
        message = decode_server_message(reply, self.limits)
        if isinstance(message, Error):
            hint = " (this server predates probe messages)" if "unknown client message type" in message.message else ""
            raise error_from_code(message.code, f"server: {message.message}{hint}")
        if not isinstance(message, ProbeReply) or message.seq != self._probe_seq:
            raise ProtocolError("the server's reply does not answer the probe that was sent.")
        if message.received != up or len(message.payload) != down:
            raise ProtocolError(f"probe sent {up} and asked for {down} bytes; the server got {message.received} "
                                f"and sent {len(message.payload)}.")
        return elapsed_ms

    def _exchange_raw(self, payload: bytes) -> bytes:
        if self._ws is None:
            raise TransportError("not connected")
        try:
            self._ws.send(payload)
            return self._ws.recv(timeout=self.reply_timeout_s)
        except TimeoutError as exc:
            self._drop()
            raise TransportError(f"no reply from {self.url} within {self.reply_timeout_s:g} s.") from exc
        except (ConnectionClosed, OSError) as exc:
            self._drop()
            raise TransportError(f"the connection to {self.url} was lost ({exc}).") from exc

    def _drop(self) -> None:
        if self._ws is not None:
            try:
                self._ws.close()
            except (OSError, ConnectionClosed):
                pass
            self._ws = None

    def close(self, end_session: bool = True) -> None:
        """Ask the server to free the session (best effort), then close the connection."""
        if self._ws is not None and end_session:
            try:
                self._ws.send(Close().encode())
            except (OSError, ConnectionClosed):
                pass
        self._drop()


class InProcessMiddle:
    """The middle layers in this process, with no wire: the whole model runs locally (`--local-only`).

    It goes through the same SessionTable as the server (same validation, same cache), but hands
    tensors over directly, so no wire rounding happens.
    """

    def __init__(self, half: CloudHalf, head_layers: int | None = None):
        self.table = SessionTable(half, SessionConfig(max_sessions=1 << 20, max_cached_tokens=1 << 40, max_block_rows=1 << 16))
        self.cloud_layers = (half.stack.start, half.stack.end)
        self.head_layers = head_layers  # as in RemoteMiddle
        self._session = None
        self.welcome: Welcome | None = None

    def open(self, resume_id: str | None = None) -> Welcome:
        hello = Hello(
            self.table.half.fingerprint, self.cloud_layers, "float32", session_id=resume_id, head_layers=self.head_layers
        )
        self._session, self.welcome = self.table.open(hello)
        return self.welcome

    def step(self, step: Step) -> tuple[Result, StepIO]:
        t0 = time.perf_counter()
        # The session was opened as float32; the tensor's own dtype is what the layers get.
        step = Step(step.seq, step.keep, step.positions, step.structure, step.hidden, wire_dtype="float32")
        result = self.table.run_step(self._session, step, t0)
        return result, StepIO((time.perf_counter() - t0) * 1e3, 0.0, 0, 0)

    def close(self, end_session: bool = True) -> None:
        if self._session is not None:
            self.table.close(self._session.id)
            self._session = None
