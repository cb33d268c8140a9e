"""A bounded load test: many concurrent sessions against one server, each checked against a solo run.

    splitinfer bench load --shards shards/smollm2 --sessions 64 --max-sessions 48 --max-new-tokens 32

The server runs in this process (so its session table can be sampled: open sessions, cached KV rows);
clients are threads sharing one local half, each with its own caches and connection. A client refused
for capacity waits and retries, which is what the retry-later error asks of it. The report says whether
every output equals the output of the same prompt run alone, the peak open sessions and cached rows
against the configured budgets, how many capacity refusals happened, the wall time and the process's
peak RSS (server and clients together). It is a tool, not a benchmark: timings on a shared CPU are noisy.
"""

from __future__ import annotations

import json
import random
import resource
import threading
import time
from dataclasses import asdict, dataclass, field

from ..errors import CapacityError
from ..options import Opt, Shared, add_options
from ..wire.dtypes import DTYPE_NAMES


@dataclass
class LoadReport:
    sessions: int
    completed: int = 0
    exact: int = 0  # outputs equal to the solo run of the same prompt
    capacity_refusals: int = 0  # retry-later errors answered to clients (each then retried)
    evictions: int | None = None  # idle sessions the server evicted to make room (clients re-prefilled)
    other_errors: list[str] = field(default_factory=list)
    peak_open_sessions: int = 0
    peak_cached_tokens: int = 0
    max_sessions: int = 0
    max_cached_tokens: int = 0
    wall_s: float = 0.0
    peak_rss_mib: float = 0.0

    @property
    def ok(self) -> bool:
        return (
            self.exact == self.sessions
            and not self.other_errors
            and self.peak_open_sessions <= self.max_sessions
            and self.peak_cached_tokens <= self.max_cached_tokens
        )


def run_load(local, server, prompts: list[list[int]], expected: list[list[int]], sessions: int,
             max_new_tokens: int, client_config, auth=None, max_wait_s: float = 600.0) -> LoadReport:
    """`sessions` clients at once against `server` (a ServerThread); session i decodes prompts[i % len]."""
    from ..decoding.loop import decode
    from ..decoding.strategies import Sequential
    from ..local.auth import ClientAuth
    from ..local.middle import RemoteMiddle
    from ..local.session import SplitSession

    table = server.server.table
    report = LoadReport(sessions, max_sessions=table.config.max_sessions, max_cached_tokens=table.config.max_cached_tokens)
    lock = threading.Lock()
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            n, rows = len(table), table.cached_tokens()
            report.peak_open_sessions = max(report.peak_open_sessions, n)
            report.peak_cached_tokens = max(report.peak_cached_tokens, rows)
            time.sleep(0.005)

    def client(i: int) -> None:
        prompt = prompts[i % len(prompts)]
        deadline = time.monotonic() + max_wait_s
        while True:
            middle = RemoteMiddle.for_shard(server.url, local.manifest, local.config.hidden_size,
                                            client_config.wire_dtype, auth=auth or ClientAuth())
            session = SplitSession(local, middle, client_config)
            tokens: list[int] = []
            try:
                logits = session.prefill(prompt)
                decode(session, prompt, logits, max_new_tokens, set(), lambda t, _lp: tokens.append(t), Sequential())
                break
            except CapacityError:
                with lock:
                    report.capacity_refusals += 1
                if time.monotonic() > deadline:
                    with lock:
                        report.other_errors.append(f"client {i}: still refused after {max_wait_s:.0f} s")
                    return
                time.sleep(random.uniform(0.05, 0.3))  # what "retry later" asks for, spread out
            except Exception as exc:  # noqa: BLE001 - counted and reported, the others go on
                with lock:
                    report.other_errors.append(f"client {i}: {type(exc).__name__}: {exc}")
                return
            finally:
                session.close()
        with lock:
            report.completed += 1
            report.exact += tokens == expected[i % len(prompts)]

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,), name=f"load-{i}") for i in range(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    report.wall_s = time.perf_counter() - start
    done.set()
    sampler.join()
    report.evictions = getattr(table, "evictions", None)
    report.peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    return report


def solo_outputs(local, cloud, prompts: list[list[int]], max_new_tokens: int, client_config) -> list[list[int]]:
    """Each prompt run alone through a fresh server: the reference every loaded session must match."""
    from ..cloud.server import ServerThread
    from ..decoding.loop import decode
    from ..decoding.strategies import Sequential
    from ..local.middle import RemoteMiddle
    from ..local.session import SplitSession

    out = []
    with ServerThread(cloud) as server:
        for prompt in prompts:
            middle = RemoteMiddle.for_shard(server.url, local.manifest, local.config.hidden_size,
                                            client_config.wire_dtype)
            session = SplitSession(local, middle, client_config)
            tokens: list[int] = []
            decode(session, prompt, session.prefill(prompt), max_new_tokens, set(), lambda t, _lp: tokens.append(t), Sequential())
            session.close()
            out.append(tokens)
    return out


def cmd_load_test(args) -> int:
    from pathlib import Path

    import torch

    from ..cloud.server import ServerConfig, ServerThread
    from ..cloud.sessions import SessionConfig
    from ..local.session import ClientConfig
    from ..model.shards import load_cloud, load_local

    if args.threads:
        torch.set_num_threads(args.threads)
    shards = Path(args.shards)
    local, cloud = load_local(shards / "local"), load_cloud(shards / "cloud")
    prompts = _prompts(local, args.prompts)
    config = ClientConfig(wire_dtype=args.wire_dtype)
    expected = solo_outputs(local, cloud, prompts, args.max_new_tokens, config)
    sessions = SessionConfig(max_sessions=args.max_sessions, max_cached_tokens=args.max_cached_tokens)
    with ServerThread(cloud, ServerConfig(port=0, sessions=sessions)) as server:
        report = run_load(local, server, prompts, expected, args.sessions, args.max_new_tokens, config)
    data = asdict(report) | {"ok": report.ok, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                             "wire_dtype": args.wire_dtype}
    print(json.dumps(data, indent=2))
    return 0 if report.ok else 1


def packaged_prompt_texts(count: int) -> list[str]:
    """The first `count` prompts of the packaged set, as text."""
    from importlib import resources

    lines = resources.files("splitinfer.data").joinpath("prompts.jsonl").read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines if line.strip()][:count]


def _prompts(local, count: int) -> list[list[int]]:
    return [list(local.tokenizer(text)["input_ids"]) for text in packaged_prompt_texts(count)]


@dataclass(frozen=True)
class LoadTestOptions:
    """The defaults of `splitinfer bench load`."""

    sessions: int = 64  # concurrent client sessions
    max_sessions: int = 48  # the server's session limit
    max_cached_tokens: int = 262_144  # the server's KV budget (rows)
    max_new_tokens: int = 32  # tokens per session
    prompts: int = 8  # distinct prompts from the packaged set
    wire_dtype: str = "float32"  # hidden states on the wire


def register(subparsers) -> None:
    s = subparsers.add_parser("load", help="many concurrent sessions against one in-process server")
    add_options(s, Shared, (Opt("shards", help="a prepared OUT directory (OUT/local + OUT/cloud)"),))
    add_options(s, LoadTestOptions, (
        Opt("sessions", help="concurrent client sessions"),
        Opt("max_sessions", help="the server's session limit"),
        Opt("max_cached_tokens", help="the server's KV budget (rows)"),
        Opt("max_new_tokens"),
        Opt("prompts", help="distinct prompts from the packaged set"),
        Opt("wire_dtype", choices=DTYPE_NAMES),
    ))
    s.add_argument("--threads", type=int, help="torch intra-op threads")
    s.set_defaults(func=cmd_load_test)
