"""A soak: clients through the OpenAI API against cloud server processes for a set time, watching for growth.

    splitinfer bench soak --shards shards/smollm2 --servers 2 --clients 8 --duration 1800 --warmup 300

The cloud servers are `splitinfer serve` child processes (with --metrics-port); the API server runs in this
process over all of them, and `clients` threads send it greedy /v1/completions requests without pause:
streamed or not, of random lengths, some abandoned mid-stream (the client closes its connection). Every
completed reply is compared with the same request answered alone before the load began. Once a second the
sampler reads, for this process and each server: resident memory, open file descriptors and threads (from
/proc), open sessions and cached KV rows (the servers' /metrics; for this process, requests in progress),
and what the allocators hold (allocator.heap: malloc's bytes in use and free, CPython's object blocks), so
that a rise in resident memory can be told apart: a leak grows what is in use, memory malloc keeps grows
what is free (reported, not judged).

After the warm-up, each series gets a least-squares line; a resource *trends upward* when its slope is more
than three standard errors above zero and its fitted growth over the run exceeds the metric's tolerance
(`TOLERANCE`, or 5% of its median). The run fails on any trend, any wrong reply or any failed request. It
writes soak.json (every sample, the fits, the request counts), soak.md (the table) and, with matplotlib,
soak.png. `--restart-every S` replaces the servers one at a time during the load (SIGTERM, drain, exit,
start on the same port: a rolling restart), and then also fails on a server that did not exit 0. The API's drafting memory is off (--memory-tokens 0 of `api`): it fills up to its cap by design.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..allocator import heap, settle_long_running
from ..errors import ConfigError
from ..options import Opt, Shared, add_options
from ..tables import table
from ..wire.dtypes import DTYPE_NAMES
from .soak_gauges import METRICS, Sampler, fits, heap_gauges, server_gauges

MODEL_ID = "soak"


@dataclass(frozen=True)
class SoakOptions:
    """The defaults of `splitinfer bench soak`."""

    servers: int = 2  # `splitinfer serve` processes; the API server spreads sessions over them
    clients: int = 8  # client threads sending requests without pause
    duration_s: float = 120.0  # seconds of load
    warmup_s: float = 20.0  # seconds at the start left out of the trend fits
    max_new_tokens: int = 48  # the longest request; lengths are drawn from a quarter, half and all of it
    abandon: float = 0.15  # fraction of streamed requests the client abandons mid-stream
    stream: float = 0.5  # fraction of requests streamed
    prompts: int = 4  # distinct prompts from the packaged set
    seed: int = 0  # the clients' random choices
    # Rolling restart: every this many seconds the next server in turn gets SIGTERM, drains, exits and is
    # started again on its port (needs 2 or more servers); 0 never restarts one.
    restart_every_s: float = 0.0
    wire_dtype: str = "float32"  # hidden states on the wire


# -- the clients -------------------------------------------------------------------------------------
def request(port: int, prompt: str, max_tokens: int, stream: bool, abandon_after: int | None) -> str | None:
    """One greedy completion through the API: its text, or None when the client abandoned it mid-stream."""
    body = json.dumps({"model": MODEL_ID, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise ConfigError(f"the API answered {response.status}: {response.read()[:300]!r}")
        if not stream:
            return json.loads(response.read())["choices"][0]["text"]
        pieces, events = [], 0
        while (line := response.readline()) and line.strip() != b"data: [DONE]":
            if not line.startswith(b"data: "):
                continue
            events += 1
            if abandon_after is not None and events > abandon_after:
                return None  # the connection closes below, mid-stream
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise ConfigError(f"the stream ended with an error: {chunk['error']['message']}")
            pieces += [c["text"] for c in chunk["choices"]]
        return "".join(pieces)
    finally:
        conn.close()


@dataclass
class Counts:
    completed: int = 0
    exact: int = 0
    abandoned: int = 0
    failed: int = 0
    streamed: int = 0


def client_loop(port: int, jobs: list[tuple[str, int]], reference: dict, options: SoakOptions, until: float,
                rng: random.Random, counts: Counts, errors: list[str], lock: threading.Lock) -> None:
    """Requests without pause until `until` (time.monotonic()), each checked against `reference`."""
    while time.monotonic() < until:
        prompt, length = rng.choice(jobs)
        stream = rng.random() < options.stream
        abandon_after = rng.randrange(1, max(2, length)) if stream and rng.random() < options.abandon else None
        try:
            text = request(port, prompt, length, stream, abandon_after)
        except (OSError, ValueError, ConfigError) as exc:  # counted and reported; the soak goes on
            with lock:
                counts.failed += 1
                errors.append(f"{type(exc).__name__}: {exc}"[:300])
            continue
        with lock:
            counts.streamed += stream
            if text is None:
                counts.abandoned += 1
            else:
                counts.completed += 1
                counts.exact += text == reference[(prompt, length)]


# -- the run -----------------------------------------------------------------------------------------
class Servers:
    """The `splitinfer serve` child processes, each with a port and a metrics port of its own, and their
    replacement one at a time on the same ports (a rolling restart: SIGTERM, wait for the exit, start)."""

    def __init__(self, stack, shard: Path, count: int, logs: Path | None = None):
        from ..launch import free_port

        self.stack, self.shard, self.logs = stack, shard, logs  # logs: a folder for server-<i>.log
        self.ports = [(free_port(), free_port()) for _ in range(count)]  # (server, metrics)
        self.procs = [self._start(i) for i in range(count)]
        self.urls = [f"ws://127.0.0.1:{port}" for port, _ in self.ports]
        self.restarts: list[dict] = []  # {"server", "exit_code", "seconds"} per restart

    def _start(self, i: int):
        from ..launch import cloud_server

        port, metrics = self.ports[i]
        log = self.logs / f"server-{i}.log" if self.logs else None
        return self.stack.enter_context(cloud_server(self.shard, threads=1, port=port, log=log,
                                                     extra=["--metrics-port", str(metrics)]))[1]

    def exited(self) -> list[dict]:
        """Servers that exited on their own (not by a restart): {"server", "exit_code"} each."""
        return [{"server": i, "exit_code": p.poll()} for i, p in enumerate(self.procs) if p.poll() is not None]

    def processes(self) -> dict:
        """{name: (() -> pid, () -> gauges)} for the Sampler; the pid follows a restart."""
        return {f"server {i}": (lambda i=i: self.procs[i].pid,
                                lambda m=metrics: server_gauges(f"http://127.0.0.1:{m}/metrics"))
                for i, (_, metrics) in enumerate(self.ports)}

    def restart(self, i: int) -> None:
        import signal

        start = time.monotonic()
        self.procs[i].send_signal(signal.SIGTERM)
        code = self.procs[i].wait(timeout=120)
        self.procs[i] = self._start(i)
        self.restarts.append({"server": i, "exit_code": code, "seconds": round(time.monotonic() - start, 2)})

    def rolling(self, every_s: float, stop: threading.Event) -> None:
        """Restart the servers in turn, one every `every_s` seconds, until `stop` is set."""
        turn = 0
        while not stop.wait(every_s):
            self.restart(turn % len(self.procs))
            turn += 1


def run_soak(shards: Path, options: SoakOptions, logs: Path | None = None) -> dict:
    """Start the servers and the API, answer every request alone, then load it for `duration_s` while sampling."""
    from contextlib import ExitStack

    from ..api.engine import Engine
    from ..api.server import ApiServer
    from ..clients import open_client
    from ..local.session import ClientConfig
    from .loadtest import packaged_prompt_texts

    texts = packaged_prompt_texts(options.prompts)
    lengths = sorted({max(1, options.max_new_tokens // 4), max(1, options.max_new_tokens // 2), options.max_new_tokens})
    jobs = [(text, n) for text in texts for n in lengths]
    with ExitStack() as stack:
        servers = Servers(stack, shards / "cloud", options.servers, logs)
        client = open_client(shards / "local", servers.urls, ClientConfig(wire_dtype=options.wire_dtype),
                             allow_public_weights=True, checks=False)
        engine = Engine(client, MODEL_ID, max_concurrent=options.clients, memory_tokens=0)
        api = stack.enter_context(ApiServer(engine, port=0))
        processes = {**servers.processes(), "api": (os.getpid, lambda: {"sessions": float(api.app.pending), "cached_rows": 0.0,
                                                                        **heap_gauges(heap())})}
        reference = {job: request(api.port, *job, stream=False, abandon_after=None) for job in jobs}
        counts, errors, lock, done = Counts(), [], threading.Lock(), threading.Event()
        with Sampler(processes) as sampler:
            until = time.monotonic() + options.duration_s
            threads = [threading.Thread(target=client_loop, daemon=True, args=(
                api.port, jobs, reference, options, until, random.Random(options.seed * 1000 + i), counts, errors, lock,
            )) for i in range(options.clients)]
            if options.restart_every_s:
                threads.append(threading.Thread(target=servers.rolling, args=(options.restart_every_s, done), daemon=True))
            for thread in threads:
                thread.start()
            for thread in threads[: options.clients]:
                thread.join()
            done.set()
            for thread in threads[options.clients :]:
                thread.join()
            time.sleep(2 * sampler.period_s)  # the idle state after the load is part of the record
        exited = servers.exited()  # before the stack stops them
    return _verdict(options, servers, counts, errors, sampler.samples, exited)


def _verdict(options: SoakOptions, servers: Servers, counts: Counts, errors: list[str], samples: dict,
             exited: list[dict] = ()) -> dict:
    """The report: counts, fits and whether the soak passed. Replaced servers start their series afresh, so
    under a rolling restart only the API process's trends count."""
    fitted = fits(samples, options.warmup_s, options.duration_s)
    judged = {name: per for name, per in fitted.items() if not servers.restarts or not name.startswith("server")}
    trending = [f"{name}: {metric}" for name, per in judged.items() for metric, fit in per.items() if fit["trending"]]
    clean_exits = all(r["exit_code"] == 0 for r in servers.restarts) and not exited
    ok = not trending and counts.exact == counts.completed and not counts.failed and counts.completed > 0 and clean_exits
    return {"ok": ok, "options": asdict(options), "servers": servers.urls, "counts": asdict(counts),
            "restarts": servers.restarts, "exited": list(exited), "errors": errors[:20], "trending": trending, "fits": fitted, "samples": samples}


def _exits(report: dict) -> str:
    gone = report.get("exited", [])
    return " (" + ", ".join(f"server {e['server']}: exit code {e['exit_code']}, see server-{e['server']}.log" for e in gone) + ")" if gone else ""


def write_report(report: dict, out: Path) -> list[Path]:
    """soak.json, soak.md and (with matplotlib) soak.png in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "soak.json", out / "soak.md"]
    paths[0].write_text(json.dumps(report, indent=1) + "\n")
    rows = []
    for name, per in report["fits"].items():
        kept = [r for r in report["samples"][name] if report["options"]["warmup_s"] <= r["t"] <= report["options"]["duration_s"]]
        for metric, fit in per.items():
            first, last = (kept[0][metric], kept[-1][metric]) if kept else ("-", "-")
            rows.append([name, metric, _num(first), _num(last), fit["slope_per_min"], fit["stderr_per_min"],
                         fit["growth"], "-" if fit.get("limit") is None else fit["limit"], "**up**" if fit["trending"] else "flat"])
    c = report["counts"]
    lines = [
        f"# Soak: {report['options']['duration_s']:g} s, {report['options']['clients']} clients, "
        f"{report['options']['servers']} servers ({'pass' if report['ok'] else 'FAIL'})", "",
        f"Requests: {c['completed']} completed ({c['exact']} equal to their solo run), {c['streamed']} streamed, "
        f"{c['abandoned']} abandoned mid-stream, {c['failed']} failed; "
        f"{len(report.get('restarts', []))} server restarts (exit codes {sorted({r['exit_code'] for r in report.get('restarts', [])})}); "
        f"{len(report.get('exited', []))} servers exited on their own{_exits(report)}. Fits from the end of the warm-up "
        f"({report['options']['warmup_s']:g} s) to the end of the load; `last` is the last sample in that window.", "",
        *table(["process", "metric", "first", "last", "slope / min", "stderr / min", "growth", "limit", "trend"], rows),
    ]
    paths[1].write_text("\n".join(lines) + "\n")
    if _plot(report, out / "soak.png"):
        paths.append(out / "soak.png")
    return paths


def _num(value) -> str:
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def _plot(report: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(len(METRICS), 1, figsize=(8, 2.2 * len(METRICS)), sharex=True)
    for ax, metric in zip(axes, METRICS):
        for name, rows in report["samples"].items():
            ax.plot([r["t"] for r in rows], [r[metric] for r in rows], label=name)
        ax.axvline(report["options"]["warmup_s"], color="grey", linestyle=":")
        ax.set_ylabel(metric)
    axes[0].legend(fontsize="small")
    axes[-1].set_xlabel("seconds (dotted: end of warm-up)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def cmd_soak(args) -> int:
    from ..options import config_from_args

    options = config_from_args(SoakOptions, args, SOAK_OPTIONS)
    if options.warmup_s >= options.duration_s:
        raise ConfigError("--warmup must be shorter than --duration: the trend is fitted on what comes after it.")
    if options.restart_every_s and options.servers < 2:
        raise ConfigError("--restart-every replaces one server at a time while the others serve; give --servers 2 or more.")
    if not Path("/proc/self/status").exists():
        raise ConfigError("bench soak reads /proc for every process's memory, fds and threads; run it on Linux.")
    settle_long_running()  # memory flat over days: mmap threshold, kernel caches capped (allocator.py)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = run_soak(Path(args.shards), options, logs=out)
    paths = write_report(report, Path(args.out))
    print(Path(paths[1]).read_text())
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if report["ok"] else 1


SOAK_OPTIONS = (
    Opt("servers", help="`splitinfer serve` processes"),
    Opt("clients", help="client threads sending requests without pause"),
    Opt("duration_s", "--duration", help="seconds of load"),
    Opt("warmup_s", "--warmup", help="seconds at the start left out of the trend fits"),
    Opt("max_new_tokens", help="the longest request (lengths: a quarter, half and all of it)"),
    Opt("abandon", help="fraction of streamed requests abandoned mid-stream"),
    Opt("stream", help="fraction of requests streamed"),
    Opt("prompts", help="distinct prompts from the packaged set"),
    Opt("seed", help="seed of the clients' random choices"),
    Opt("restart_every_s", "--restart-every", help="rolling restart: every this many seconds the next server gets "
                                                   "SIGTERM, drains and is started again (0: never)"),
    Opt("wire_dtype", choices=DTYPE_NAMES),
)


def register(subparsers) -> None:
    s = subparsers.add_parser("soak", help="clients through the API against server processes for a set time; "
                                           "fails when memory, fds, threads, sessions or cached rows grow")
    add_options(s, Shared, (Opt("shards", help="a prepared OUT directory (OUT/local + OUT/cloud)"),
                            Opt("out", help="where soak.json, soak.md and soak.png go")))
    add_options(s, SoakOptions, SOAK_OPTIONS)
    s.set_defaults(func=cmd_soak)
