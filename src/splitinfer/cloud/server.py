"""The cloud server: a WebSocket adapter over SessionTable. It only moves bytes and schedules work.

Decoding and validation happen on the event loop (cheap); the middle layers run on one worker thread,
so one session's compute never stalls another connection's I/O. permessage-deflate is off: float16
activations do not compress, and inflating small frames into huge ones is a classic bomb; `max_size`
bounds every message instead.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from ..errors import ProtocolError, SplitInferError
from ..model.shards import CloudHalf
from ..wire.messages import Close, Error, Hello, Limits, Step, decode_client_message
from .sessions import CloudSession, SessionConfig, SessionTable

log = logging.getLogger("splitinfer.cloud")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # interface to listen on
    port: int = 8765  # 0 picks a free port
    sessions: SessionConfig = SessionConfig()
    sweep_interval_s: float = 5.0  # how often idle sessions are looked for


class CloudServer:
    def __init__(self, half: CloudHalf, config: ServerConfig = ServerConfig()):
        self.half = half
        self.config = config
        self.table = SessionTable(half, config.sessions)
        self.limits = Limits(
            hidden_size=half.config.hidden_size, max_block_rows=config.sessions.max_block_rows
        )
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="splitinfer-compute")
        self._server = None
        self.port: int | None = None

    async def _handle(self, ws: ServerConnection) -> None:
        session: CloudSession | None = None
        loop = asyncio.get_running_loop()
        try:
            async for data in ws:
                received_at = time.perf_counter()
                seq = None
                try:
                    message = decode_client_message(data, self.limits)
                    if isinstance(message, Hello):
                        session, welcome = self.table.open(message)
                        await ws.send(welcome.encode())
                    elif isinstance(message, Step):
                        seq = message.seq
                        if session is None:
                            raise ProtocolError("send hello before the first step.")
                        session = self.table.get(session.id)  # raises if it expired meanwhile
                        reply = await loop.run_in_executor(self._executor, self._compute, session, message, received_at)
                        await ws.send(reply)
                    elif isinstance(message, Close):
                        if session is not None:
                            self.table.close(session.id)
                        session = None
                        await ws.close()
                        return
                except SplitInferError as exc:
                    log.info("error for %s: %s: %s", ws.remote_address, exc.code, exc)
                    await ws.send(Error.from_exception(exc, seq).encode())
        except ConnectionClosed:
            pass  # the session stays until its TTL, so the client can resume it
        except Exception:  # noqa: BLE001 - the server must keep serving everyone else
            log.exception("unexpected failure on a connection from %s", ws.remote_address)
            await ws.close(code=1011, reason="internal error")

    def _compute(self, session: CloudSession, step: Step, received_at: float) -> bytes:
        # One hop to the worker thread per step: compute and encode together.
        return self.table.run_step(session, step, received_at).encode()

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
            ping_interval=20,
            ping_timeout=60,
        )
        self.port = self._server.sockets[0].getsockname()[1] if self._server.sockets else self.config.port
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        stack = self.half.stack
        log.info(
            "serving layers [%d, %d) of %s on ws://%s:%d",
            stack.start, stack.end, self.half.manifest["model_id"], self.config.host, self.port,
        )

    async def stop(self) -> None:
        if self._server is not None:
            self._sweeper.cancel()
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        self._executor.shutdown(wait=True)

    async def serve_forever(self) -> None:
        await self.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await self.stop()


class ServerThread:
    """A CloudServer on its own event loop in a daemon thread (tests, benchmarks, local-only tools)."""

    def __init__(self, half: CloudHalf, config: ServerConfig = ServerConfig(port=0)):
        self.server = CloudServer(half, config)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="splitinfer-server", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self._loop).result(timeout=30)

    @property
    def url(self) -> str:
        return f"ws://{self.server.config.host}:{self.server.port}"

    def close(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self.server.stop(), self._loop).result(timeout=30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
