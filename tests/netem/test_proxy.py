"""Tests for the user-space WAN emulator (loopback only, bounded waits)."""

from __future__ import annotations

import asyncio
import logging
import random
import selectors
import socket
import socketserver
import statistics
import threading
import time

import pytest

from splitinfer.netem import WanConfig, WanProxy, start_proxy_thread
from splitinfer.netem.clock import Lead, PreciseEpoll
from splitinfer.netem.proxy import _Link, _Schedule

TIMEOUT = 5.0


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (OSError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


def _proxy_tasks() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if t.get_coro().__qualname__.startswith(("WanProxy.", "_Pipe."))]


async def _with_proxy(config: WanConfig, body, handler=_echo) -> WanProxy:
    loop_errors: list[dict] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: loop_errors.append(ctx))
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    proxy = WanProxy("127.0.0.1", server.sockets[0].getsockname()[1], config)
    await proxy.start()
    try:
        await asyncio.wait_for(body(proxy), 10)
    finally:
        await proxy.close()
        server.close()
        await server.wait_closed()
    assert _proxy_tasks() == []
    assert loop_errors == []
    return proxy


async def _connect(proxy: WanProxy):
    return await asyncio.open_connection("127.0.0.1", proxy.port)


async def _echo_rtts(config: WanConfig, samples: int = 5) -> list[float]:
    rtts: list[float] = []

    async def body(proxy: WanProxy) -> None:
        reader, writer = await _connect(proxy)
        for i in range(samples + 1):
            msg = b"ping-%04d" % i
            t0 = time.perf_counter()
            writer.write(msg)
            assert await asyncio.wait_for(reader.readexactly(len(msg)), TIMEOUT) == msg
            if i:  # the first exchange warms up the upstream connection
                rtts.append(time.perf_counter() - t0)
        writer.close()

    await _with_proxy(config, body)
    return rtts


def test_config_validation() -> None:
    WanConfig(rtt_ms=80, jitter_ms=5, bandwidth_mbit=40, seed=1)
    for bad in (dict(rtt_ms=-1), dict(jitter_ms=-0.5), dict(rtt_ms=float("nan")), dict(jitter_ms=float("inf")),
                dict(bandwidth_mbit=0), dict(bandwidth_mbit=-3), dict(bandwidth_mbit=float("inf"))):
        with pytest.raises(ValueError, match="must be"):
            WanConfig(**bad)


def test_schedule_orders_and_serializes() -> None:
    cfg = WanConfig(rtt_ms=20, jitter_ms=8, bandwidth_mbit=8, seed=3)  # 8 Mbit/s = 1 byte per microsecond
    link = _Link(cfg)
    sched = _Schedule(cfg, link, random.Random(3))
    times = [sched.delivery(0.0, 1000) for _ in range(50)]
    assert times == sorted(times)
    assert link.free_at == pytest.approx(50 * 1000e-6)
    assert times[-1] >= 0.05 + 0.010 - 0.008  # serialization + one-way delay - jitter
    again = _Schedule(cfg, _Link(cfg), random.Random(3))
    assert [again.delivery(0.0, 1000) for _ in range(50)] == times  # same seed, same jitter


def test_bytes_pass_unchanged_with_jitter() -> None:
    payload = random.Random(0).randbytes(1_000_000)

    async def body(proxy: WanProxy) -> None:
        reader, writer = await _connect(proxy)
        # Small messages first: order must survive jitter larger than the spacing between them.
        msgs = [b"<%05d>" % i for i in range(200)]
        for m in msgs:
            writer.write(m)
            await writer.drain()
        expected = b"".join(msgs)
        assert await asyncio.wait_for(reader.readexactly(len(expected)), TIMEOUT) == expected
        writer.write(payload)
        writer.write_eof()  # half-close must reach the server, and its close must come back
        received = await asyncio.wait_for(reader.read(), TIMEOUT)
        assert received == payload
        writer.close()

    proxy = asyncio.run(_with_proxy(WanConfig(rtt_ms=10, jitter_ms=4, seed=7), body))
    assert proxy.stats["bytes_up"] == proxy.stats["bytes_down"] == 200 * 7 + len(payload)
    assert proxy.stats["connections"] == 1 and proxy.stats["active"] == 0


def test_server_close_reaches_client() -> None:
    async def greet_and_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"bye")
        await writer.drain()
        writer.close()

    async def body(proxy: WanProxy) -> None:
        reader, writer = await _connect(proxy)
        assert await asyncio.wait_for(reader.read(), TIMEOUT) == b"bye"  # data, then EOF
        writer.close()
        for _ in range(100):  # the proxy finishes the connection once the client closes too
            if proxy.stats["active"] == 0:
                break
            await asyncio.sleep(0.01)
        assert proxy.stats["active"] == 0

    asyncio.run(_with_proxy(WanConfig(rtt_ms=20, jitter_ms=5), body, handler=greet_and_close))


@pytest.mark.slow
@pytest.mark.timing  # measures the emulated delay itself: a wall-clock bound is the point
def test_rtt_added() -> None:
    rtt = statistics.median(asyncio.run(_echo_rtts(WanConfig(rtt_ms=80))))
    print(f"median echo round trip at rtt_ms=80: {rtt * 1000:.1f} ms")
    assert 0.080 <= rtt < 0.080 + 0.040


@pytest.mark.slow
@pytest.mark.timing  # measures the emulated delay itself: a wall-clock bound is the point
def test_no_delay_without_rtt() -> None:
    assert statistics.median(asyncio.run(_echo_rtts(WanConfig()))) < 0.020


@pytest.mark.slow
@pytest.mark.timing  # measures the emulated delay itself: a wall-clock bound is the point
def test_bandwidth_limit() -> None:
    total = 1_000_000

    async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        got = 0
        while got < total and (data := await reader.read(65536)):
            got += len(data)
        writer.write(b"k")
        await writer.drain()
        writer.close()

    elapsed: list[float] = []

    async def body(proxy: WanProxy) -> None:
        reader, writer = await _connect(proxy)
        t0 = time.perf_counter()
        writer.write(b"x" * total)
        await writer.drain()
        assert await asyncio.wait_for(reader.readexactly(1), TIMEOUT) == b"k"
        elapsed.append(time.perf_counter() - t0)
        writer.close()

    asyncio.run(_with_proxy(WanConfig(bandwidth_mbit=40), body, handler=sink))
    floor = total * 8 / 40e6
    assert floor * 0.9 <= elapsed[0] < floor + 1.0


def test_close_closes_client_connections() -> None:
    async def main() -> None:
        server = await asyncio.start_server(_echo, "127.0.0.1", 0)
        proxy = WanProxy("127.0.0.1", server.sockets[0].getsockname()[1], WanConfig(rtt_ms=2))
        await proxy.start()
        reader, writer = await _connect(proxy)
        writer.write(b"hello")
        assert await asyncio.wait_for(reader.readexactly(5), TIMEOUT) == b"hello"
        assert proxy.stats["active"] == 1
        await asyncio.wait_for(proxy.close(), TIMEOUT)
        try:
            assert await asyncio.wait_for(reader.read(), TIMEOUT) == b""
        except ConnectionResetError:
            pass  # also an acceptable way to learn the connection is gone
        assert proxy.stats["active"] == 0
        writer.close()
        server.close()
        await server.wait_closed()

    asyncio.run(main())


def test_upstream_refused(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as s:  # a port nobody listens on any more
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]

    async def main() -> None:
        proxy = WanProxy("127.0.0.1", dead_port, WanConfig(rtt_ms=10))
        await proxy.start()
        reader, writer = await _connect(proxy)
        assert await asyncio.wait_for(reader.read(), TIMEOUT) == b""
        writer.close()
        await proxy.close()

    with caplog.at_level(logging.WARNING, logger="splitinfer.netem"):
        asyncio.run(main())
    assert [r for r in caplog.records if r.name == "splitinfer.netem" and "unreachable" in r.getMessage()]


class _EchoHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


@pytest.mark.slow
@pytest.mark.timing  # measures the emulated delay itself: a wall-clock bound is the point
def test_proxy_thread_blocking_client() -> None:
    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), _EchoHandler) as server:
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            with start_proxy_thread("127.0.0.1", server.server_address[1], WanConfig(rtt_ms=40)) as pt:
                with socket.create_connection(("127.0.0.1", pt.port), timeout=TIMEOUT) as c:
                    t0 = time.perf_counter()
                    c.sendall(b"abc")
                    got = b""
                    while len(got) < 3:
                        chunk = c.recv(3 - len(got))
                        assert chunk
                        got += chunk
                    assert got == b"abc" and time.perf_counter() - t0 >= 0.040
                pt.close()
                pt.close()  # idempotent
                assert not pt._thread.is_alive()
        finally:
            server.shutdown()


def test_wan_command_rejects_bad_fault_options_with_a_sentence(capsys):
    from splitinfer.cli import main

    assert main(["wan", "--listen", "0", "--upstream", "127.0.0.1:1", "--spike-prob", "2"]) == 2
    err = capsys.readouterr().err
    assert "spike_prob must lie in [0, 1]" in err and "Traceback" not in err


def test_lead_learns_the_loops_lateness_and_stays_bounded() -> None:
    lead, late_by = Lead(), 0.0003  # a wake aimed at t comes at t + 0.3 ms
    for _ in range(200):
        lead.observe(late_by - lead.seconds)  # aimed at the moment minus the lead
    assert lead.seconds == pytest.approx(late_by, rel=1e-3)
    for _ in range(200):
        lead.observe(0.05)
    assert lead.seconds == Lead.MAX_LEAD_S
    for _ in range(200):
        lead.observe(-0.05)
    assert lead.seconds == 0.0


@pytest.mark.skipif(not hasattr(selectors, "EpollSelector"), reason="epoll is Linux's")
def test_precise_epoll_reports_ready_sockets() -> None:
    a, b = socket.socketpair()
    with a, b, PreciseEpoll() as selector:
        selector.register(a, selectors.EVENT_READ)
        assert selector.select(0.0005) == []  # nothing to read: the timeout runs out
        b.send(b"x")
        assert [key.fileobj for key, _ in selector.select(5.0)] == [a]
