"""`splitinfer serve`: the cloud side's command, a thin layer over CloudServer.

Options that mirror ServerConfig, SessionConfig and BatchConfig are derived from them (options.py), so
their defaults live in those dataclasses only. Everything is checked before the shard loads. Nothing
heavy is imported at module level.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import argparse
import asyncio
import logging

from ..allocator import settle_long_running
from ..errors import ConfigError
from ..options import DEVICE, HOST, MIB, THREADS, Opt, Shared, add_options, config_from_args, defer
from ..wire.dtypes import DTYPE_NAMES

log = logging.getLogger("splitinfer.cloud")

SERVER_OPTIONS = (
    HOST,
    Opt("port"),
    Opt("tls_cert", help="PEM certificate chain; with --tls-key, serve wss://"),
    Opt("tls_key", help="PEM private key of --tls-cert"),
    Opt("client_ca", help="require client certificates signed by this PEM CA (mutual TLS)"),
    Opt("drain_timeout_s", "--drain-timeout",
        help="on SIGTERM, seconds the steps in progress may take before the server exits anyway"),
)
SESSION_OPTIONS = (
    Opt("ttl_s", "--session-ttl", help="seconds an idle session keeps its cache"),
    Opt("max_sessions", help="open sessions at once; more are told to retry later"),
    Opt("max_cached_tokens", help="KV rows over all sessions"),
    Opt("max_message_bytes", "--max-message-mb", scale=MIB, help="largest accepted message, MiB"),
    Opt("max_kv_bytes", "--kv-budget-mb", scale=MIB, type=float,
        help="KV cache memory over all sessions, MiB (idle sessions are evicted first)"),
    Opt("evict_idle_s", help="a session idle this long may be evicted for room"),
    Opt("max_sessions_per_owner", "--max-sessions-per-token", help="sessions one client token may hold at once"),
)
BATCH_OPTIONS = (
    Opt("window_ms", "--batch-window-ms",
        help="longest wait to batch concurrent sessions' steps (never spent by a lone session)"),
    Opt("max_batch", help="steps per batched pass (1: one session at a time)"),
)


@dataclass(frozen=True)
class ServeOptions:
    """`splitinfer serve`'s defaults beyond ServerConfig, SessionConfig and BatchConfig."""

    tp: int = 1  # ranks every middle layer is split over (tensor parallel; > 1 starts torchrun)
    # Benchmarks only: every pass lasts at least this long (cloud/passtime.py; bench spec --cloud-pass-ms)
    min_pass_ms: float = 0.0
    # Blocks of at least this many rows run through torch.compile (CPU; 0: every pass eager). Measured
    # in notes/bench/compile: faster from four rows, slower for one row at long context; minutes to compile.
    compile_rows: int = 0
    # Lone blocks of up to 64 rows as CUDA graphs by bucket of rows (model/graphs.py). auto: on a CUDA device;
    # static: the graphs' static-shape pass without capture, on any device (checks their logic, no gain).
    graphs: str = "auto"


def _serve_options(s: argparse.ArgumentParser) -> None:
    from ..model.graphs import MODES as GRAPH_MODES
    from .rayserve import RayConfig as RAY_DEFAULTS
    from .scheduler import BatchConfig
    from .server import ServerConfig
    from .sessions import SessionConfig

    s.add_argument("--shard", required=True, help="the cloud shard directory (OUT/cloud)")
    add_options(s, ServerConfig, SERVER_OPTIONS)
    add_options(s, SessionConfig, SESSION_OPTIONS)
    add_options(s, BatchConfig, BATCH_OPTIONS)
    add_options(s, Shared, (DEVICE,))
    s.add_argument("--devices", help="spread the layers over several GPUs by memory: cuda:0,cuda:1 or auto")
    s.add_argument("--dtype", choices=DTYPE_NAMES, help="compute dtype (default: the shard's; GPUs: float16/bfloat16)")
    add_options(s, Shared, (THREADS,))
    s.add_argument("--token-file", help="accepted bearer tokens, one per line (or set SPLITINFER_SERVER_TOKENS)")
    s.add_argument("--metrics-port", type=int, help="serve Prometheus metrics at http://METRICS_HOST:PORT/metrics")
    add_options(s, Shared, (Opt("host", "--metrics-host", help="interface for --metrics-port (default loopback)"),))
    s.add_argument("--ray", action="store_true",
                   help="run the cloud half as Ray Serve replicas, each on its own port from --port on (the ray extra)")
    s.add_argument("--replicas", type=int, default=RAY_DEFAULTS.replicas, help="with --ray: replicas to run")
    s.add_argument("--max-replicas", type=int,
                   help="with --ray: autoscale up to this many replicas on KV bytes reserved and capacity refusals")
    s.add_argument("--address", help="with --ray: an existing Ray cluster (default: start a local one)")
    add_options(s, ServeOptions, (Opt("tp", metavar="N", help="split every middle layer over N ranks (tensor "
                                                                "parallel; starts torchrun with N processes)"),
                                  Opt("min_pass_ms", help="benchmarks only: every forward pass lasts at least this "
                                                          "many ms (a GPU's flat pass time)"),
                                  Opt("compile_rows", metavar="N",
                                      help="run blocks of N or more rows through torch.compile (CPU only; compiles "
                                           "for minutes before serving; 0: off; 4 measured fastest)"),
                                  Opt("graphs", choices=GRAPH_MODES,
                                      help="replay steps of up to 64 rows as CUDA graphs by bucket of rows (auto: on "
                                           "a CUDA device; static: their static-shape pass uncaptured, any device)")))
    s.add_argument("--insecure", action="store_true",
                   help="serve a non-loopback address without tokens or TLS (only on a trusted network)")


def register(subparsers) -> None:
    s = subparsers.add_parser("serve", help="serve the middle layers (the untrusted side)")
    defer(s, _serve_options)
    s.set_defaults(func=cmd_serve)


def _server_config(args):
    """ServerConfig from the options, or a ConfigError saying which option to fix; loads nothing."""
    from .scheduler import BatchConfig
    from .security import exposure_problem, load_server_tokens, server_ssl_context
    from .server import ServerConfig
    from .sessions import SessionConfig

    if bool(args.tls_cert) != bool(args.tls_key):
        raise ConfigError("give --tls-cert and --tls-key together.")
    if args.client_ca and not args.tls_cert:
        raise ConfigError("--client-ca needs TLS; give --tls-cert and --tls-key too.")
    if args.max_sessions_per_token is not None and args.max_sessions_per_token < 1:
        raise ConfigError("--max-sessions-per-token must be at least 1.")
    tokens = load_server_tokens(args.token_file)
    if args.tls_cert:
        server_ssl_context(args.tls_cert, args.tls_key, args.client_ca)  # fail now, not at the first client
    problem = exposure_problem(args.host, tokens, bool(args.tls_cert))
    if problem and not args.insecure:
        raise ConfigError(problem)
    if problem:
        log.warning("--insecure: %s", problem.split(":")[0])
    if (args.kv_budget_mb is not None and args.kv_budget_mb <= 0) or args.evict_idle_s < 0:
        raise ConfigError("--kv-budget-mb must be positive (or left out) and --evict-idle-s not negative.")
    sessions = config_from_args(SessionConfig, args, SESSION_OPTIONS)
    batching = config_from_args(BatchConfig, args, BATCH_OPTIONS)
    return config_from_args(ServerConfig, args, SERVER_OPTIONS, sessions=sessions, batching=batching, tokens=tokens)


def _serve_ray(args, config) -> int:
    """`serve --ray`: the replicas run until Ctrl-C; prints the URLs to give clients (repeat --server)."""
    import signal
    import threading

    from .rayserve import RayConfig, deploy, shutdown

    try:
        ray_config = RayConfig(replicas=args.replicas, max_replicas=args.max_replicas, address=args.address)
    except ValueError as exc:
        raise ConfigError(f"{exc} Fix --replicas / --max-replicas.") from exc
    urls = deploy(args.shard, config, ray_config, device=args.device, dtype=args.dtype, threads=args.threads,
                  graphs=args.graphs)
    print("replicas:", " ".join(f"--server {url}" for url in urls), flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    shutdown()
    return 0


def _serve_tp(args, config) -> int:
    """`serve --tp N`: outside torchrun, start torchrun with N copies of this command; inside, be one rank."""
    import os

    from .server import CloudServer
    from .tensorparallel import (
        Rank0Passes, check_launch, join_group, load_rank, relaunch_under_torchrun, worker_loop,
    )

    if "WORLD_SIZE" not in os.environ:
        check_launch(args.shard, args.tp, args.device)
        relaunch_under_torchrun(args.tp, args.argv)
    rank, device = join_group(args.tp, args.device)
    _set_threads(args.threads)
    half = load_rank(args.shard, rank, args.tp, device, args.dtype)
    if rank != 0:
        worker_loop(half)
        return 0
    passes = Rank0Passes(half)
    one_block = replace(config, sessions=replace(config.sessions, max_in_flight=1))  # no prefixes broadcast
    try:
        _run_server(CloudServer(half, one_block, passes), args)
    finally:
        passes.stop_workers()
    return 0


def _set_threads(threads: int | None) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


def _run_server(server, args) -> None:
    if args.metrics_port is not None:
        from ..metrics import CloudMetrics, serve_metrics

        server.metrics = CloudMetrics(server.table)
        serve_metrics(server.metrics, args.metrics_host, args.metrics_port)
    asyncio.run(server.serve_forever())


def compile_cloud(stack, min_rows: int) -> None:
    """Switch the stack to compiled passes for blocks of `min_rows` rows or more and compile them before
    any client connects (a first client would otherwise wait minutes on a CPU)."""
    import time

    stack.compile_passes(min_rows)
    started = time.perf_counter()
    log.info("compiling the passes of %d+ rows (torch.compile; minutes on a CPU)...", min_rows)
    for rows in sorted({min_rows, max(min_rows, 2)}):  # one row is its own graph; two and more share one
        stack.warm_up(rows)
    log.info("compiled in %.0f s", time.perf_counter() - started)


def cmd_serve(args) -> int:
    settle_long_running()  # memory flat over days: mmap threshold, kernel caches capped (allocator.py)
    if args.compile_rows < 0:
        raise ConfigError(f"--compile-rows must be 0 (off) or a row count, not {args.compile_rows}.")
    if args.compile_rows and (args.tp != 1 or args.ray or args.devices):
        raise ConfigError("--compile-rows is measured for one CPU process only; leave out --tp, --ray and --devices.")
    if args.tp != 1 and (args.ray or args.devices):
        raise ConfigError("--tp splits each layer over the ranks of one group; leave out --ray and --devices.")
    if args.tp != 1:
        return _serve_tp(args, _server_config(args))
    if args.ray:
        from ..extras import RAY, require_extra

        require_extra("ray", RAY, "splitinfer serve --ray")
        if args.devices or args.metrics_port is not None:
            raise ConfigError("--ray runs each replica on its own device; leave out --devices and --metrics-port.")
        return _serve_ray(args, _server_config(args))
    if args.devices:
        from ..extras import GPU, require_extra

        require_extra("gpu", GPU, "splitinfer serve --devices")
    from ..model.graphs import use_graphs
    from ..model.shards import load_cloud
    from .server import CloudServer

    config = _server_config(args)
    _set_threads(args.threads)
    half = load_cloud(args.shard, device="cpu" if args.devices else args.device, dtype=args.dtype)
    if args.devices:  # several GPUs of this node: layers placed by memory (model/placement.py)
        from ..model.placement import parse_devices, spread

        device_map = spread(half.stack, parse_devices(args.devices), half.stack.compute_dtype)
        log.info("layer placement: %s", device_map)
    passes = None
    if args.min_pass_ms:  # the fast-cloud benchmark's stand-in for a GPU, never in the server's own pass
        from .batch import LocalPasses
        from .passtime import MinPassTime

        passes = MinPassTime(LocalPasses(half), args.min_pass_ms)
    if args.compile_rows:
        compile_cloud(half.stack, args.compile_rows)
    use_graphs(half.stack, args.graphs, several_devices=bool(args.devices))
    _run_server(CloudServer(half, config, passes), args)
    return 0
