"""What `bench soak` watches and how it judges it: every process's resources sampled once a second, and a
least-squares trend per resource after the warm-up.

`Sampler` reads, for each process it is given, resident memory, open file descriptors and threads (/proc)
and the gauges its caller supplies (a server's /metrics: sessions, cached KV rows, the allocators' figures).
`trend` says whether one series grows beyond noise: its slope more than three standard errors above zero and
its fitted growth over the run past the metric's tolerance (`TOLERANCE`, or 5% of its median); `fits` does
that for every process and metric. Nothing here starts a server or a client (soak.py does).
"""

from __future__ import annotations

import os
import threading
import time
import urllib.request
from pathlib import Path

from ..metrics import HEAP_GAUGES
from ..options import MIB

METRICS = ("rss_mib", "fds", "threads", "sessions", "cached_rows", "heap_in_use_mib", "heap_free_mib", "python_blocks")
# Growth over the run, after warm-up, below which a slope is noise whatever its standard error. The heap's
# free bytes are memory malloc keeps, not a leak: reported, never judged (None).
TOLERANCE = {"rss_mib": 16.0, "fds": 4.0, "threads": 4.0, "sessions": 2.0, "cached_rows": 256.0,
             "heap_in_use_mib": 16.0, "heap_free_mib": None, "python_blocks": 20_000.0}


# -- sampling ----------------------------------------------------------------------------------------
def proc_stats(pid: int) -> dict:
    """Resident MiB, open file descriptors and threads of process `pid`, from /proc."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    fields = dict(line.split(":", 1) for line in status if ":" in line)
    if "VmRSS" not in fields:  # a process that has exited and not been waited for (a zombie) has no memory
        raise ProcessLookupError(f"process {pid} has exited")
    return {"rss_mib": int(fields["VmRSS"].split()[0]) / 1024, "fds": fds, "threads": int(fields["Threads"])}


def server_gauges(metrics_url: str) -> dict:
    """Open sessions and cached KV rows of a server, from its Prometheus /metrics."""
    with urllib.request.urlopen(metrics_url, timeout=5) as response:
        text = response.read().decode()
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    heap = {key: float(values[name]) for key, (name, _) in HEAP_GAUGES.items()}
    return {"sessions": float(values["splitinfer_active_sessions"]), "cached_rows": float(values["splitinfer_kv_cache_tokens"]),
            **heap_gauges(heap)}


def heap_gauges(heap: dict) -> dict:
    """allocator.heap()'s figures in the soak's units."""
    return {"heap_in_use_mib": heap["in_use_bytes"] / MIB, "heap_free_mib": heap["free_bytes"] / MIB,
            "python_blocks": heap["python_blocks"]}


class Sampler:
    """Samples every process once a second on a thread of its own: {process: [sample, ...]}."""

    def __init__(self, processes: dict[str, tuple[int, object]], period_s: float = 1.0):
        self.processes = processes  # name -> (() -> pid, () -> {"sessions", "cached_rows"})
        self.period_s = period_s
        self.samples: dict[str, list[dict]] = {name: [] for name in processes}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="splitinfer-soak-sampler", daemon=True)
        self.start = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            t = round(time.monotonic() - self.start, 3)
            for name, (pid, gauges) in self.processes.items():
                try:
                    self.samples[name].append({"t": t, **proc_stats(pid()), **gauges()})
                except OSError:  # a server being restarted: no sample this second
                    pass

    def __enter__(self) -> "Sampler":
        self.start = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


# -- trends ------------------------------------------------------------------------------------------
def trend(times: list[float], values: list[float], tolerance: float | None) -> dict:
    """The least-squares line through (times, values): slope per minute, its standard error, the fitted growth
    over the span, and whether that is an upward trend beyond noise (module docstring)."""
    import numpy as np

    t, v = np.asarray(times, dtype=float), np.asarray(values, dtype=float)
    if len(t) < 3 or np.ptp(t) == 0:
        return {"slope_per_min": 0.0, "stderr_per_min": 0.0, "growth": 0.0, "trending": False, "samples": len(t)}
    slope, intercept = np.polyfit(t, v, 1)
    residual = v - (slope * t + intercept)
    stderr = float(np.sqrt((residual @ residual) / (len(t) - 2) / ((t - t.mean()) @ (t - t.mean()))))
    growth = float(slope * np.ptp(t))
    limit = None if tolerance is None else round(max(tolerance, 0.05 * abs(float(np.median(v)))), 3)
    trending = bool(limit is not None and slope > 3 * stderr and growth > limit)
    return {"slope_per_min": round(float(slope) * 60, 4), "stderr_per_min": round(stderr * 60, 4),
            "growth": round(growth, 3), "limit": limit, "trending": trending, "samples": len(t)}


def fits(samples: dict[str, list[dict]], warmup_s: float, end_s: float = float("inf")) -> dict:
    """{process: {metric: trend}} over the samples after the warm-up and before `end_s` (the load's end)."""
    out = {}
    for name, rows in samples.items():
        kept = [r for r in rows if warmup_s <= r["t"] <= end_s]
        out[name] = {m: trend([r["t"] for r in kept], [r[m] for r in kept], TOLERANCE[m]) for m in METRICS}
    return out
