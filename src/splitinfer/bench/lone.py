"""`bench batch`'s lone session: what the server's compute path costs a session that is alone.

The same one-row decode step of one session (about `context` cached rows), timed round by round
(bench/harness.py `rounds`, so drift on a shared machine hits every path alike) along each path:

- direct: `SessionTable.run_step` on this thread, the step and nothing else;
- scheduler: through the batching scheduler's compute thread (`Scheduler.submit`), the path `serve` takes;
- executor: through a plain one-thread executor (the server's compute path before batching);
- server (`server=True`): through a real CloudServer on loopback (no WAN), from a client on this thread:
  both sides' encoding and decoding, the event loop, the scheduler, the WebSocket both ways. Before every
  timed call (of any path, untimed) another session opens, steps and closes on that server, as sessions
  come and go on a real one: the batch window must not be spent waiting for a session that closed.

The target (issue 65): through the scheduler within 1.1x of direct (the median over rounds of each round's
ratio). A GPU's step is a few ms, so a fixed cost on this path is a large share of it there; on a CPU it
shows only where the step is short (int8 shards). It knows no command line; batching.py calls it.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from .harness import median_ms, paired_ratio, rounds
from .stepping import SteppedSessions

TARGET = 1.1  # the scheduler's step over the direct one


class _ServerPath:
    """A lone session on an in-process server, stepped one row at a time by a client on this thread."""

    def __init__(self, half, context: int):
        import torch

        from ..cloud.server import ServerConfig, ServerThread
        from ..local.middle import RemoteMiddle

        self.torch = torch
        self.d = half.config.hidden_size
        self.server = ServerThread(half, ServerConfig(port=0))
        manifest = {"split": {"cloud_layers": [half.stack.start, half.stack.end]},
                    "cloud_fingerprint": half.fingerprint}

        def client():
            return RemoteMiddle.for_shard(self.server.url, manifest, self.d, "float16")

        self._client = client
        try:
            self.middle = client()
            self._prefill(self.middle, context)
        except BaseException:
            self.server.close()
            raise
        self.seq, self.keep, self.position = 1, tuple(range(context)), context

    def _prefill(self, middle, rows: int) -> None:
        from ..masks import BlockStructure
        from ..wire.messages import Step

        middle.open()
        hidden = self.torch.randn(rows, self.d, dtype=self.torch.float16)
        middle.step(Step(0, (), tuple(range(rows)), BlockStructure.chain(), hidden, "float16"))

    def churn(self) -> None:
        """Another session opens, prefills 8 rows and closes; returns once the server has closed it."""
        other = self._client()
        self._prefill(other, 8)
        other.close()
        deadline = time.monotonic() + 30
        while len(self.server.server.table) > 1:  # the close is handled a moment after the client hangs up
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not close a finished session within 30 s")
            time.sleep(1e-4)

    def step(self) -> None:
        from ..masks import BlockStructure
        from ..wire.messages import Step

        hidden = self.torch.randn(1, self.d, dtype=self.torch.float16)
        self.middle.step(Step(self.seq, self.keep, (self.position,), BlockStructure.chain(), hidden, "float16"))
        self.seq, self.keep, self.position = self.seq + 1, (0,), self.position + 1

    def close(self) -> dict:
        """Close the client and the server; returns the server's scheduler stats."""
        try:
            self.middle.close()
            return self.server.server.scheduler.stats()
        finally:
            self.server.close()


def lone_session(half, context: int, samples: int, server: bool = False) -> dict:
    """Median ms of the lone step along each path, and the ratios to direct (module docstring)."""
    from ..cloud.scheduler import BatchConfig, Scheduler

    lone = SteppedSessions(half, 1, context)
    session = lone.sessions[0]
    scheduler = Scheduler(lone.table, BatchConfig())
    executor = ThreadPoolExecutor(max_workers=1)
    calls = {
        "direct": lambda: lone.table.run_step(session, lone.step(0, 1), 0.0),
        "scheduler": lambda: scheduler.submit(session, lone.step(0, 1), 0.0).result(timeout=60),
        "executor": lambda: executor.submit(lone.table.run_step, session, lone.step(0, 1), 0.0).result(timeout=60),
    }
    remote = stats = None
    try:
        if server:
            remote = _ServerPath(half, context)
            calls["server"] = remote.step
        times = rounds(calls, samples, before=None if remote is None else remote.churn)
    finally:
        scheduler.close()
        executor.shutdown()
        if remote is not None:
            stats = remote.close()
    medians = {path: median_ms(values) for path, values in times.items()}
    result = {
        "direct_ms": medians["direct"], "via_scheduler_ms": medians["scheduler"],
        "via_executor_ms": medians["executor"],
        "scheduler_minus_executor_ms": round(medians["scheduler"] - medians["executor"], 3),
        "scheduler_vs_direct": paired_ratio(times["scheduler"], times["direct"]),
        "executor_vs_direct": paired_ratio(times["executor"], times["direct"]),
        "samples": len(times["direct"]),
    }
    if remote is not None:
        result |= {"via_server_ms": medians["server"], "server_vs_direct": paired_ratio(times["server"], times["direct"]),
                   # every pass of that server, the other sessions' included (their steps may wait for the lone one)
                   "server_window_waits": stats.get("window_waits"), "server_window_wait_ms": stats.get("window_wait_ms")}
    return result


def markdown(lone: dict) -> list[str]:
    """The lone session's lines of batching.md."""
    lines = [f"Lone session, median of {lone['samples']} interleaved steps: {lone['direct_ms']} ms called directly, "
             f"{lone['via_scheduler_ms']} ms through the batching scheduler, {lone['via_executor_ms']} ms through a "
             f"one-thread executor (the unbatched server's path): scheduler - executor = "
             f"{lone['scheduler_minus_executor_ms']} ms."]
    if "via_server_ms" in lone:
        lines[0] += (f" Through a server on loopback (client and server in this process, encoding, event loop and "
                     f"WebSocket included; another session closed before each step): {lone['via_server_ms']} ms, "
                     f"{lone['server_vs_direct']}x direct.")
    if "scheduler_vs_direct" in lone:
        met = "met" if lone["scheduler_vs_direct"] <= TARGET else "not met"
        lines += ["", f"Target: a lone session through the scheduler within {TARGET}x of the step called directly "
                      f"(median of the rounds' ratios): **{lone['scheduler_vs_direct']}x** ({met})."]
    return lines
