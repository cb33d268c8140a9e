"""Start `splitinfer serve` and `splitinfer wan` as child processes (the benchmarks), and `splitinfer demo`.

Each child can be pinned to one CPU core with a fixed number of threads, which is how both sides are
measured fairly on a small machine: the cloud on one core, the client on another. This module is the one
place that pins (`pin_self`, `pinned`, and `spawn` for children) and that starts and stops child processes
(`spawn`, `stop`): the benchmarks use it rather than their own. The demo runs both children on loopback and
generates through them.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError
from .netem.commands import WAN_RTT_MS
from .options import ALLOW_PUBLIC_WEIGHTS, SHARDS, Opt, Shared, add_options


def _can_pin(cpu: int | None) -> bool:
    """True where this machine has core `cpu` and the OS lets a process choose its cores."""
    return cpu is not None and hasattr(os, "sched_setaffinity") and 0 <= cpu < (os.cpu_count() or 1)


def pin_self(cpu: int | None, threads: int = 1) -> None:
    """Pin this process to core `cpu` (where the machine has it; None: leave the cores alone) with `threads`
    torch threads: the client's side of the same fairness the children get."""
    import torch

    if _can_pin(cpu):
        os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(threads)


@contextmanager
def pinned(cpu: int | None, threads: int):
    """`pin_self` for the length of a `with`: the cores and thread count come back on the way out (a caller in
    the same process, such as a test, keeps its own)."""
    import torch

    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    before = torch.get_num_threads()
    try:
        pin_self(cpu, threads)
        yield
    finally:
        if affinity is not None:
            os.sched_setaffinity(0, affinity)
        torch.set_num_threads(before)


_HANDED_OUT: set[int] = set()  # ports free_port gave this process: never twice


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands to bind(0) and to outgoing connections (Linux's ip_local_port_range)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A loopback port nobody listens on, for a child to bind a moment later.

    Chosen below the ephemeral range: a port from bind(0) is free again once we close it, and any outgoing
    connection of any process (a readiness probe, a client) may take it as its local port before the child
    binds it, which fails the child's bind (seen in CI). Ports below the range are only ever taken by
    explicit binds. Falls back to bind(0) where no such port is free."""
    import random

    low, _ = _ephemeral_range()
    candidates = range(max(1024, low - 12000), low)
    for port in random.sample(candidates, min(64, len(candidates))):
        if port not in _HANDED_OUT and _binds(port):
            _HANDED_OUT.add(port)
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _binds(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _tail(log: Path | None, lines: int = 8) -> str:
    """The last lines a child wrote to `log`, for an error that says why it exited ('' without one)."""
    if log is None or not Path(log).exists():
        return ""
    text = Path(log).read_text(errors="replace").strip().splitlines()[-lines:]
    return (" Its last output:\n" + "\n".join(text)) if text else ""


def wait_for_port(port: int, proc: subprocess.Popen, timeout_s: float = 120.0, log: Path | None = None) -> None:
    """Return once something listens on `port`; a ConfigError (with the tail of `log`) if `proc` exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ConfigError(f"the child process exited with code {proc.returncode} before listening on {port}."
                              + _tail(log))
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise ConfigError(f"nothing listened on port {port} within {timeout_s:.0f} s.")


def spawn(args: list[str], cpu: int | None, threads: int | None, quiet: bool, log: Path | None = None,
          module: str = "splitinfer") -> subprocess.Popen:
    """`python -m module *args` as a child pinned to core `cpu` (where the machine has it) with `threads` threads
    (OMP_NUM_THREADS and its --threads option); its output dropped when quiet, or appended to `log`."""
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
        args = [*args, "--threads", str(threads)]
    preexec = None
    if _can_pin(cpu):
        preexec = lambda: os.sched_setaffinity(0, {cpu})  # noqa: E731
    out = subprocess.DEVNULL if quiet else None
    if log is not None:  # appended, so a restarted server's log follows the one before it
        with open(log, "ab") as out:
            return subprocess.Popen([sys.executable, "-m", module, *args], env=env, preexec_fn=preexec, stdout=out,
                                    stderr=subprocess.STDOUT)
    return subprocess.Popen([sys.executable, "-m", module, *args], env=env, preexec_fn=preexec, stdout=out, stderr=out)


def stop(proc: subprocess.Popen) -> None:
    """Terminate a child, and kill it if it has not exited 10 s later."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


@contextmanager
def cloud_server(
    shard: str | Path,
    cpu: int | None = None,
    threads: int | None = None,
    quiet: bool = True,
    extra=(),
    token_file: str | Path | None = None,
    tls_cert: str | Path | None = None,
    tls_key: str | Path | None = None,
    port: int | None = None,
    log: Path | None = None,
    ready_timeout_s: float = 120.0,
):
    """Yields (URL, process) of a server child on a loopback port: wss:// with tls_cert/tls_key, else ws://.
    `log`: a file its stdout and stderr are appended to (else they are dropped when quiet);
    `ready_timeout_s`: how long it may take to listen (a server compiling its passes takes minutes).

    Tokens go by file (never on the command line, where `ps` shows them); `port` reuses a port, e.g. to
    restart a server where its clients expect it.
    """
    port = port or free_port()
    args = ["serve", "--shard", str(shard), "--port", str(port), *extra]
    if token_file:
        args += ["--token-file", str(token_file)]
    if tls_cert:
        args += ["--tls-cert", str(tls_cert), "--tls-key", str(tls_key or tls_cert)]
    with listening_child(args, port, cpu, threads, quiet, log, ready_timeout_s) as proc:
        yield f"{'wss' if tls_cert else 'ws'}://127.0.0.1:{port}", proc


@contextmanager
def listening_child(args: list[str], port: int, cpu: int | None, threads: int | None, quiet: bool = True,
                    log: Path | None = None, timeout_s: float = 120.0, module: str = "splitinfer"):
    """Yields a `spawn`ed child once it listens on `port`, and stops it on the way out. A quiet child without
    `log` writes to a temporary file (gone on exit), so one that exits before listening says why in the error."""
    with _kept_output(log, quiet) as log:
        proc = spawn(args, cpu, threads, quiet, log, module)
        try:
            wait_for_port(port, proc, timeout_s, log)
            yield proc
        finally:
            stop(proc)


@contextmanager
def _kept_output(log: Path | None, quiet: bool):
    if log is not None or not quiet:
        yield log
        return
    import tempfile

    with tempfile.TemporaryDirectory(prefix="splitinfer-child-") as folder:
        yield Path(folder) / "output.log"


@contextmanager
def wan_proxy(upstream_url: str, rtt_ms: float, cpu: int | None = None, jitter_ms: float = 0.0, bandwidth_mbit: float | None = None):
    """Yields the URL of a `splitinfer wan` child in front of `upstream_url` (a loopback ws:// or wss:// URL).

    The proxy relays TCP bytes, so TLS passes through it end to end and the scheme stays the same.
    """
    scheme, _, host_port = upstream_url.partition("://")
    port = free_port()
    args = ["wan", "--listen", str(port), "--upstream", host_port, "--rtt-ms", str(rtt_ms), "--jitter-ms", str(jitter_ms)]
    if bandwidth_mbit:
        args += ["--bandwidth-mbit", str(bandwidth_mbit)]
    with listening_child(args, port, cpu, None, timeout_s=30):
        yield f"{scheme}://127.0.0.1:{port}"


DEMO_PROMPT = "Explain in three sentences why the round trip dominates split inference over a WAN."


def cmd_demo(args) -> int:
    from .clients import load_checked_local, open_client
    from .local.commands import stats_table

    shards = Path(args.shards)
    # Loaded and checked (synthetic or refused public weights) before the server starts, once: the client takes it.
    local = load_checked_local(shards / "local", allow_public_weights=args.allow_public_weights, command="demo")
    print(f"starting the cloud server on loopback with {shards / 'cloud'} (middle layers only) ...", flush=True)
    with cloud_server(shards / "cloud") as (url, _proc), wan_proxy(url, args.rtt_ms) as wan_url:
        print(f"cloud at {url}, reached through an emulated WAN at {wan_url} (+{args.rtt_ms:g} ms round trip)\n")
        client = open_client(shards / "local", wan_url, local=local, checks=False)
        print(f"prompt: {args.prompt}\n")
        result = client.generate(
            args.prompt, max_new_tokens=args.max_new_tokens, on_text=lambda t: (sys.stdout.write(t), sys.stdout.flush())
        )
        print(f"\n\n[{result.finish_reason}] split, {result.stats['strategy']} decoding, float16 wire")
        print(stats_table(result.stats))
    return 0


@dataclass(frozen=True)
class DemoOptions:
    """`splitinfer demo`'s defaults beyond the shared ones."""

    max_new_tokens: int = 96  # tokens the demo generates


def register(subparsers) -> None:
    s = subparsers.add_parser("demo", help="serve + emulated WAN + generate, on loopback")
    add_options(s, Shared, (SHARDS,))
    s.add_argument("--rtt-ms", type=float, default=WAN_RTT_MS, help="added round trip of the emulated WAN")
    add_options(s, DemoOptions, (Opt("max_new_tokens"),))
    s.add_argument("--prompt", default=DEMO_PROMPT)
    add_options(s, Shared, (ALLOW_PUBLIC_WEIGHTS,))
    s.set_defaults(func=cmd_demo)
