"""How close the WAN emulator's round trip is to the one it is told: an echo server behind `splitinfer wan`.

    python scripts/bench_wan.py --out notes/bench/wan --rtt-ms 80 [--other-src DIR]

An echo server and the proxy run as child processes on core 1, the client here on core 0 (as `bench spec`
places the cloud and the emulator); the client sends a message, waits for all of it back, rests 10 ms, and
again. Per setting: median, fastest and slowest round trip, and the median's excess over the added round trip.
`--other-src`: also time the proxy of another source tree (its `src` directory, a `git worktree` of an
earlier commit, say), alternating with this one round by round, so both rows come from one run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import splitinfer
from splitinfer.bench.provenance import source_commit
from splitinfer.launch import free_port, stop, wait_for_port, wan_proxy
from splitinfer.tables import table

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


def echo_server(port: int) -> subprocess.Popen:
    """The echo server, a child on core 1 (where the machine has two cores), once it listens."""
    pin = (lambda: os.sched_setaffinity(0, {1})) if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1 else None
    proc = subprocess.Popen([sys.executable, "-c", ECHO, str(port)], preexec_fn=pin)
    wait_for_port(port, proc, 30)
    return proc


def round_trips(port: int, size: int, count: int) -> list[float]:
    """ms of `count` echo round trips of `size` bytes (after 5 untimed ones)."""
    msg, times = b"x" * size, []
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(count + 5):
            t0 = time.perf_counter()
            c.sendall(msg)
            got = 0
            while got < size:
                got += len(c.recv(65536))
            if i >= 5:
                times.append((time.perf_counter() - t0) * 1e3)
            time.sleep(0.01)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--rtt-ms", type=float, default=80.0)
    parser.add_argument("--size", type=int, default=2048, help="bytes a message")
    parser.add_argument("--count", type=int, default=50, help="timed round trips a setting a round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--other-src", help="another tree's src directory, whose proxy is timed alternately")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {0})
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
    commits = {"this tree": source_commit(), "other tree": source_commit(args.other_src) if args.other_src else None}
    rows = []
    for name, ms in times.items():
        added = 0.0 if name == "no proxy" else args.rtt_ms
        rows.append([name, commits.get(name) or "-", added, round(statistics.median(ms), 3), round(min(ms), 3),
                     round(max(ms), 3), round(statistics.median(ms) - added, 3)])
    report = {"command": "python " + shlex.join(sys.argv), "splitinfer": splitinfer.__version__,
              "commit": source_commit(), "platform": platform.platform(), "size": args.size, "count": args.count,
              "rounds": args.rounds, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "wan.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = ["# The WAN emulator's round trip against the one it is told", "", f"`{report['command']}`", "",
             f"An echo server and each proxy on core 1, the client on core 0; {args.size}-byte messages, "
             f"{args.count} timed round trips a setting in each of {args.rounds} rounds (the settings alternate "
             "within a round), 10 ms apart; ms (scripts/bench_wan.py).", "",
             *table(["proxy", "source", "added RTT ms", "median", "fastest", "slowest", "median - added"], rows,
                    "|---|---|---:|---:|---:|---:|---:|"), ""]
    (args.out / "wan.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
