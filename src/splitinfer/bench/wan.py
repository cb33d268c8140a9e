"""`splitinfer bench wan`: how close the WAN emulator's round trip is to the one it is told, an echo server behind
`splitinfer wan`.

An echo server and the proxy run as child processes on core 1, the client here on core 0 (as `bench spec` places
the cloud and the emulator); the client sends a message, waits for all of it back, rests 10 ms, and again. Per
setting: median, fastest and slowest round trip, and the median's excess over the added round trip.
`--other-src`: also time the proxy of another source tree (its `src` directory, a `git worktree` of an earlier
commit, say), alternating with this one round by round, so both rows come from one run.
Writes OUT/wan.json and OUT/wan.md.
"""

from __future__ import annotations

import contextlib
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ..launch import free_port, pinned, stop, wait_for_port, wan_proxy
from ..tables import table
from .harness import command_line, write
from .provenance import source_commit

ECHO = """
import socket, sys, threading
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
def serve(c):
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while (d := c.recv(65536)): c.sendall(d)
while True:
    c, _ = s.accept(); threading.Thread(target=serve, args=(c,), daemon=True).start()
"""
UNTIMED = 5  # round trips before the timed ones of a setting
REST_S = 0.01  # between round trips


def echo_server(port: int) -> subprocess.Popen:
    """The echo server, a child on core 1 (where the machine has two cores), once it listens."""
    two_cores = hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1
    pin = (lambda: os.sched_setaffinity(0, {1})) if two_cores else None
    proc = subprocess.Popen([sys.executable, "-c", ECHO, str(port)], preexec_fn=pin)
    wait_for_port(port, proc, 30)
    return proc


def round_trips(port: int, size: int, count: int) -> list[float]:
    """ms of `count` echo round trips of `size` bytes (after UNTIMED ones)."""
    msg, times = b"x" * size, []
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(count + UNTIMED):
            t0 = time.perf_counter()
            c.sendall(msg)
            got = 0
            while got < size:
                got += len(c.recv(65536))
            if i >= UNTIMED:
                times.append((time.perf_counter() - t0) * 1e3)
            time.sleep(REST_S)
    return times


@contextlib.contextmanager
def proxy(src: str | None, upstream: int, rtt_ms: float):
    """The port of a `splitinfer wan` child on core 1 in front of the echo server; `src`: the tree it imports."""
    saved = os.environ.get("PYTHONPATH")
    if src:
        os.environ["PYTHONPATH"] = src  # the child inherits it
    try:
        with wan_proxy(f"ws://127.0.0.1:{upstream}", rtt_ms, cpu=1) as url:
            yield int(url.rsplit(":", 1)[1])
    finally:
        if src and saved is None:
            del os.environ["PYTHONPATH"]
        elif src:
            os.environ["PYTHONPATH"] = saved


def measure(args) -> dict[str, list[float]]:
    """ms of every round trip, by setting: no proxy, this tree's proxy and, given --other-src, the other's."""
    echo_port = free_port()
    echo = echo_server(echo_port)
    settings = {"this tree": None, **({"other tree": args.other_src} if args.other_src else {})}
    times: dict[str, list[float]] = {name: [] for name in ("no proxy", *settings)}
    try:
        for _ in range(args.rounds):
            times["no proxy"] += round_trips(echo_port, args.size, args.count)
            for name, src in settings.items():
                with proxy(src, echo_port, args.rtt_ms) as port:
                    times[name] += round_trips(port, args.size, args.count)
    finally:
        stop(echo)
    return times


def run(args, log=print) -> dict:
    with pinned(0 if (os.cpu_count() or 1) > 1 else None, 1):  # the client on core 0, in the provenance too
        times = measure(args)
        commits = {"this tree": source_commit(),
                   "other tree": source_commit(args.other_src) if args.other_src else None}
        rows = []
        for name, ms in times.items():
            added = 0.0 if name == "no proxy" else args.rtt_ms
            rows.append([name, commits.get(name) or "-", added, round(statistics.median(ms), 3), round(min(ms), 3),
                         round(max(ms), 3), round(statistics.median(ms) - added, 3)])
        report = {"size": args.size, "count": args.count, "rounds": args.rounds, "rows": rows}
        body = [f"An echo server and each proxy on core 1, the client on core 0; {args.size}-byte messages, "
                f"{args.count} timed round trips a setting in each of {args.rounds} rounds (the settings alternate "
                f"within a round), {REST_S * 1e3:g} ms apart; ms.", "",
                *table(["proxy", "source", "added RTT ms", "median", "fastest", "slowest", "median - added"], rows,
                       "|---|---|---:|---:|---:|---:|---:|")]
        write(Path(args.out), "wan", report, body, title="The WAN emulator's round trip against the one it is told",
              command=command_line(args), log=log)
    return report
