"""User-space WAN emulator: a TCP proxy that adds delay, jitter and a bandwidth limit.

The kernel on our machines has no ``netem`` qdisc, so this proxy sits between a client and
a server and delays the bytes it relays.  Per connection and direction, a reader task stamps
each chunk it reads with its arrival time and computes when it may be delivered; a writer task
sleeps until that moment and writes it.  Bytes of one direction are never reordered: a chunk is
never delivered before the chunk in front of it, so on a busy stream the delay drifts toward
the upper end of the jitter range.  The bandwidth limit serializes chunks (in ~1 ms slices) on
a link shared by all connections of the proxy, one per direction, like a real access line.

Faults, for testing recovery: a connection can be cut (both sides reset) once it has relayed N bytes
or after t seconds, for the first K connections or all of them, and any chunk can be hit by a delay
spike with a given probability.

What it does not do: it delays TCP byte chunks, not IP packets, so there is no packet loss,
no reordering, no duplication and no congestion-control dynamics; the TCP handshake itself is
not delayed (only the data and the FIN that follow it).  The proxy is protocol-agnostic.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from typing import Any

from .clock import Lead, run_loop, sleep_until

log = logging.getLogger("splitinfer.netem")

_CHUNK = 64 * 1024
_MSS = 1448  # slicing finer than one TCP segment would model nothing real
_CONNECT_TIMEOUT_S = 10.0
_Payload = bytes | BaseException | None  # None marks EOF


@dataclass(frozen=True)
class WanConfig:
    rtt_ms: float = 0.0  # added round trip, split evenly between the two directions
    jitter_ms: float = 0.0  # uniform +/- jitter per chunk and direction, never reordering bytes
    bandwidth_mbit: float | None = None  # per-direction serialization rate; None = unlimited
    seed: int | None = None  # for reproducible jitter and spikes
    cut_after_bytes: int | None = None  # reset a connection once it relayed this many bytes (both directions)
    cut_after_s: float | None = None  # reset a connection this long after it was accepted
    cut_connections: int | None = None  # cut only the first K connections (None: every one), so recovery can finish
    spike_ms: float = 0.0  # extra one-way delay of a spike
    spike_prob: float = 0.0  # probability that a chunk (per direction) is hit by a spike
    spike_count: int | None = None  # at most this many spikes per direction over all connections (None: no limit)

    def __post_init__(self) -> None:
        for name in ("cut_after_bytes", "cut_connections", "spike_count"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be an integer >= 0 or None (got {value!r}).")
        for name in ("cut_after_s", "spike_ms"):
            value = getattr(self, name)
            if value is not None and (not math.isfinite(value) or value < 0):
                raise ValueError(f"{name} must be a finite number >= 0 (got {value!r}).")
        if not 0.0 <= self.spike_prob <= 1.0:
            raise ValueError(f"spike_prob must lie in [0, 1] (got {self.spike_prob!r}).")
        for name in ("rtt_ms", "jitter_ms"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0 (got {value!r}); pass 0 to disable it.")
        bw = self.bandwidth_mbit
        if bw is not None and (not math.isfinite(bw) or bw <= 0):
            raise ValueError(f"bandwidth_mbit must be a finite number > 0 (got {bw!r}); pass None for an unlimited link.")

    def describe(self) -> str:
        bw = f"{self.bandwidth_mbit:g} Mbit/s per direction" if self.bandwidth_mbit else "unlimited bandwidth"
        faults = ""
        if self.cut_after_bytes is not None or self.cut_after_s is not None:
            which = "every connection" if self.cut_connections is None else f"the first {self.cut_connections} connection(s)"
            after = " or ".join(
                x for x in (
                    f"{self.cut_after_bytes} bytes" if self.cut_after_bytes is not None else "",
                    f"{self.cut_after_s:g} s" if self.cut_after_s is not None else "",
                ) if x
            )
            faults += f", cutting {which} after {after}"
        if self.spike_prob:
            faults += f", +{self.spike_ms:g} ms spikes on {self.spike_prob:.1%} of chunks"
        return f"rtt {self.rtt_ms:g} ms, jitter +/-{self.jitter_ms:g} ms, {bw}{faults}"


class _Cut(ConnectionResetError):
    """An injected fault: the proxy resets the connection on purpose."""


class _Link:
    """One direction of the emulated line; shared so parallel connections compete for bandwidth."""

    def __init__(self, config: WanConfig) -> None:
        self.byte_time = 8.0 / (config.bandwidth_mbit * 1e6) if config.bandwidth_mbit else 0.0
        self.free_at = 0.0
        self.spikes_left = config.spike_count  # the fault budget is the line's, not one connection's
        # Serialize in about 1 ms slices so a big read does not arrive as one late lump.
        self.slice = max(_MSS, min(_CHUNK, int(1e-3 / self.byte_time))) if self.byte_time else _CHUNK
        self.lead = Lead()  # the event loop's lateness, the same for every connection


class _Schedule:
    """Delivery times for one direction of one connection (pure arithmetic, no I/O)."""

    def __init__(self, config: WanConfig, link: _Link, rng: random.Random) -> None:
        self._one_way = config.rtt_ms / 2000.0
        self._jitter = config.jitter_ms / 1000.0
        self._spike, self._spike_prob = config.spike_ms / 1000.0, config.spike_prob
        self._link, self._rng = link, rng
        self._last = 0.0

    def delivery(self, arrival: float, nbytes: int) -> float:
        sent = arrival
        if self._link.byte_time:
            # Store-and-forward: the chunk is complete at the far end once its last bit is on the wire.
            sent = max(arrival, self._link.free_at) + nbytes * self._link.byte_time
            self._link.free_at = sent
        delay = self._one_way + (self._rng.uniform(-self._jitter, self._jitter) if self._jitter else 0.0)
        link = self._link
        if self._spike_prob and link.spikes_left != 0 and self._rng.random() < self._spike_prob:
            delay += self._spike
            link.spikes_left = None if link.spikes_left is None else link.spikes_left - 1
        self._last = max(sent + max(delay, 0.0), self._last)  # max() keeps bytes in order under jitter
        return self._last


def _buffer_limit(config: WanConfig) -> int:
    # Enough to fill the delay line (bandwidth-delay product, assuming 10 Gbit/s when unlimited),
    # but finite, so a fast sender feels TCP backpressure instead of growing our memory.
    rate = config.bandwidth_mbit * 1e6 / 8 if config.bandwidth_mbit else 1.25e9
    bdp = rate * (config.rtt_ms / 2 + config.jitter_ms) / 1000
    return int(min(max(4 << 20, 2 * bdp), 256 << 20))


class _Pipe:
    """Relays src -> dst through the delay line; returns after EOF was delivered, raises on errors."""

    def __init__(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, schedule: _Schedule,
                 link: _Link, limit: int, stats: dict[str, int], counter: str,
                 budget: list[float] | None = None) -> None:
        self._budget = budget  # [bytes left before an injected cut], shared by both directions
        self._src, self._dst, self._schedule, self._link = src, dst, schedule, link
        self._limit, self._stats, self._counter = limit, stats, counter
        self._queue: asyncio.Queue[tuple[float, _Payload]] = asyncio.Queue()
        self._buffered = 0
        self._room = asyncio.Event()
        self._room.set()

    async def run(self) -> None:
        reader = asyncio.create_task(self._read())
        try:
            await self._write()
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        end: _Payload = None
        try:
            while data := await self._src.read(_CHUNK):
                arrival = loop.time()
                for i in range(0, len(data), self._link.slice):
                    piece = data[i:i + self._link.slice]
                    self._queue.put_nowait((self._schedule.delivery(arrival, len(piece)), piece))
                self._buffered += len(data)
                while self._buffered > self._limit:
                    self._room.clear()
                    await self._room.wait()
        except OSError as exc:
            end = exc  # delivered after the data in front of it, like a RST on a real link
        self._queue.put_nowait((self._schedule.delivery(loop.time(), 0), end))

    async def _write(self) -> None:
        loop = asyncio.get_running_loop()
        held: tuple[float, _Payload] | None = None
        while True:
            when, payload = held or await self._queue.get()
            held = None
            if when > loop.time():
                await sleep_until(loop, when - self._link.lead.seconds)
                self._link.lead.observe(loop.time() - when)
                while loop.time() < when:  # woke early: the last microseconds, so nothing goes before its moment
                    pass
            if payload is None:
                with contextlib.suppress(OSError):  # the peer may already be gone; EOF is moot then
                    if self._dst.can_write_eof():
                        self._dst.write_eof()  # half-close: the other direction keeps flowing
                    else:
                        self._dst.close()
                return
            if isinstance(payload, BaseException):
                raise payload
            # Coalesce whatever is already due so a backlog costs one write, not one per slice.
            parts, now = [payload], loop.time()
            while not self._queue.empty():
                nxt = self._queue.get_nowait()
                if nxt[0] > now or not isinstance(nxt[1], bytes):
                    held = nxt
                    break
                parts.append(nxt[1])
            data = b"".join(parts)
            if self._budget is not None:
                if len(data) >= self._budget[0]:
                    self._dst.write(data[: int(self._budget[0])])
                    self._stats["cuts"] += 1
                    raise _Cut("netem: connection cut after the configured number of bytes")
                self._budget[0] -= len(data)
            self._dst.write(data)
            await self._dst.drain()
            self._buffered -= len(data)
            self._stats[self._counter] += len(data)
            if self._buffered <= self._limit:
                self._room.set()


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def _close_writer(writer: asyncio.StreamWriter, abort: bool) -> None:
    if abort:
        writer.transport.abort()
    else:
        writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), 2.0)
    except (OSError, asyncio.TimeoutError, asyncio.CancelledError):
        # A peer that stopped reading must not stall us, and a close() racing this cleanup must
        # not end the handler task as cancelled (see WanProxy._handle).
        writer.transport.abort()


class WanProxy:
    def __init__(self, upstream_host: str, upstream_port: int, config: WanConfig,
                 listen_host: str = "127.0.0.1", listen_port: int = 0) -> None:
        self.upstream_host, self.upstream_port, self.config = upstream_host, upstream_port, config
        self.listen_host, self.port = listen_host, listen_port
        self.stats: dict[str, int] = {"bytes_up": 0, "bytes_down": 0, "connections": 0, "active": 0, "cuts": 0}
        self._cuts_left = config.cut_connections
        self._links = (_Link(config), _Link(config))
        self._limit = _buffer_limit(config)
        self._seeder = random.Random(config.seed)
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[Any]] = set()
        self._closing = False

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.listen_host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        self._closing = True
        if self._server is not None:
            self._server.close()
        for task in list(self._conns):
            task.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    def _takes_a_fault(self) -> bool:
        if self.config.cut_after_bytes is None and self.config.cut_after_s is None:
            return False
        if self._cuts_left is None:
            return True
        if self._cuts_left > 0:
            self._cuts_left -= 1
            return True
        return False

    async def _cut_later(self, after_s: float, *writers: asyncio.StreamWriter) -> None:
        await asyncio.sleep(after_s)
        self.stats["cuts"] += 1
        for writer in writers:  # both sides see the link die at once, as on a real outage
            writer.transport.abort()

    async def _handle(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        self._conns.add(asyncio.current_task())  # type: ignore[arg-type]
        u_writer: asyncio.StreamWriter | None = None
        abort = True
        try:
            if self._closing:
                return
            try:
                u_reader, u_writer = await asyncio.wait_for(
                    asyncio.open_connection(self.upstream_host, self.upstream_port), _CONNECT_TIMEOUT_S)
            except (OSError, asyncio.TimeoutError) as exc:
                log.warning("upstream %s:%s unreachable (%s); closing the client connection",
                            self.upstream_host, self.upstream_port, exc or type(exc).__name__)
                abort = False
                return
            self.stats["connections"] += 1
            self.stats["active"] += 1
            _nodelay(c_writer)
            _nodelay(u_writer)
            cut, timer = self._takes_a_fault(), None
            budget = [float(self.config.cut_after_bytes)] if cut and self.config.cut_after_bytes is not None else None
            pipes = []
            for (src, dst, counter), link in zip(
                    [(c_reader, u_writer, "bytes_up"), (u_reader, c_writer, "bytes_down")], self._links):
                rng = random.Random(self._seeder.getrandbits(64))
                pipes.append(_Pipe(src, dst, _Schedule(self.config, link, rng), link, self._limit,
                                   self.stats, counter, budget))
            tasks = [asyncio.create_task(p.run()) for p in pipes]
            if cut and self.config.cut_after_s is not None:
                timer = asyncio.create_task(self._cut_later(self.config.cut_after_s, c_writer, u_writer))
            try:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            finally:
                for task in tasks:
                    task.cancel()
                results = await asyncio.gather(*tasks, return_exceptions=True)
                if timer is not None:
                    timer.cancel()
            errors = [r for r in results if isinstance(r, BaseException)]
            abort = bool(errors)
            for err in errors:  # disconnects are ordinary; anything else is a bug worth seeing
                ordinary = isinstance(err, (OSError, asyncio.CancelledError))
                log.log(logging.DEBUG if ordinary else logging.ERROR, "netem connection aborted: %r", err)
        except asyncio.CancelledError:
            pass  # close() stopped us; a cancelled callback task makes asyncio 3.11 log a bogus error
        except Exception as exc:  # a bug, not a disconnect: say so once, never as an unretrieved task
            log.error("netem connection handler failed: %r", exc)
        finally:
            if u_writer is not None:
                self.stats["active"] -= 1
                await _close_writer(u_writer, abort)
            await _close_writer(c_writer, abort and not self._closing)
            self._conns.discard(asyncio.current_task())  # type: ignore[arg-type]


def run_wan(listen_host: str, listen_port: int, upstream_host: str, upstream_port: int,
            config: WanConfig) -> None:
    """Blocking: run until KeyboardInterrupt/SIGTERM; print one line to stderr saying what it listens on and the settings."""

    async def main() -> None:
        proxy = WanProxy(upstream_host, upstream_port, config, listen_host, listen_port)
        await proxy.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, stop.set)
        print(f"netem: listening on {listen_host}:{proxy.port}, forwarding to {upstream_host}:{upstream_port} "
              f"with {config.describe()}", file=sys.stderr, flush=True)
        try:
            await stop.wait()
        finally:
            await proxy.close()

    with contextlib.suppress(KeyboardInterrupt):
        run_loop(main)


class ProxyThread:
    """A WanProxy on its own event loop in a daemon thread; see start_proxy_thread()."""

    def __init__(self, proxy: WanProxy) -> None:
        self.proxy = proxy
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=lambda: run_loop(self._main), name="netem-proxy", daemon=True)

    @property
    def port(self) -> int:
        return self.proxy.port

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        try:
            await self.proxy.start()
        except BaseException as exc:
            self._error = exc
            return
        finally:
            self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await self.proxy.close()

    def close(self) -> None:
        with self._lock:
            if self._loop is not None and self._stop is not None:
                with contextlib.suppress(RuntimeError):  # loop already gone
                    self._loop.call_soon_threadsafe(self._stop.set)
            if self._thread.is_alive() and self._thread is not threading.current_thread():
                self._thread.join(timeout=10)

    def __enter__(self) -> ProxyThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_proxy_thread(upstream_host: str, upstream_port: int, config: WanConfig,
                       listen_host: str = "127.0.0.1", listen_port: int = 0) -> ProxyThread:
    """Run a WanProxy on its own event loop in a daemon thread (for tests/benchmarks in one process).

    Returns an object with .port and .close() (idempotent, joins the thread); also a context manager.
    """
    pt = ProxyThread(WanProxy(upstream_host, upstream_port, config, listen_host, listen_port))
    pt._thread.start()
    if not pt._ready.wait(timeout=10):
        raise RuntimeError("netem proxy thread did not start within 10 s")
    if pt._error is not None:
        pt._thread.join(timeout=10)
        raise pt._error
    return pt
