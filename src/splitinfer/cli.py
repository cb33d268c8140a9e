"""The one CLI: a thin layer over the Python API.

    splitinfer prepare   --out shards/smollm2 [--model PATH_OR_GGUF] [--head-layers 2 | --split-range 2-4] [--tail-layers 2]
                         [--dtype float32]
    splitinfer serve     --shard shards/smollm2/cloud [--host 127.0.0.1] [--port 8765] [--session-ttl 300] [--max-sessions N]
                         [--token-file F --tls-cert F --tls-key F [--client-ca F]] [--insecure]
                         [--device cuda --dtype bfloat16 | --devices cuda:0,cuda:1] [--kv-budget-mb M] [--max-batch 64]
    splitinfer generate  --shard shards/smollm2/local --server ws://127.0.0.1:8765 --prompt "..." [--json]
    splitinfer generate  --local-only [--shards shards/smollm2 | --model PATH_OR_GGUF] --prompt "..."
    splitinfer wan       --listen 9000 --upstream 127.0.0.1:8765 --rtt-ms 80 [--jitter-ms J] [--bandwidth-mbit B]
    splitinfer demo      --shards shards/smollm2 [--rtt-ms 80]
    splitinfer bench     --shards shards/smollm2 [--out docs/bench] [--quick]   (also: probe, plan)
    splitinfer bench-spec --shards shards/smollm2 [--out docs/bench]
    splitinfer bench-batch --shards shards/smollm2 [--out DIR]   (batched vs one-at-a-time cloud, 1-64 sessions)
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import sys
import tempfile
from pathlib import Path

from .errors import SplitInferError
from .local.auth import add_client_auth_args, client_auth_from_args

DTYPE_CHOICES = ("float32", "float16", "bfloat16")

# Subcommands that live beside the code they drive. Each module has `register(subparsers)`, which adds
# its parsers with `set_defaults(func=...)`; it must import nothing heavy (torch) at module level.
COMMAND_MODULES: tuple[str, ...] = ("splitinfer.api.commands", "splitinfer.configfile", "splitinfer.bench.commands", "splitinfer.bench.batching", "splitinfer.cloud.loadtest", "splitinfer.privacy.commands")


def _threads(args) -> None:
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)


def parse_split_range(text: str) -> tuple[int, int]:
    """'K1-K2' -> (K1, K2) with 1 <= K1 < K2."""
    low, sep, high = text.partition("-")
    if not sep or not low.strip().isdigit() or not high.strip().isdigit() or not 1 <= int(low) < int(high):
        raise SplitInferError(f"--split-range must be K1-K2 with 1 <= K1 < K2, e.g. 2-4 (got {text!r}).")
    return int(low), int(high)


def cmd_prepare(args) -> int:
    from .model.shards import prepare
    from .model.source import load_source
    from .progress import progress

    split_range = parse_split_range(args.split_range) if args.split_range else None  # fail before loading
    with progress(total=2, desc="prepare: loading the model", unit="step") as bar:
        source = load_source(args.model)
        bar.set_description("prepare: writing the shards")
        bar.update(1)
        out = prepare(source, args.out, args.head_layers, args.tail_layers, args.dtype, split_range=split_range)
        bar.update(1)
    manifest = json.loads((out / "cloud" / "manifest.json").read_text())
    split = manifest["split"]
    low, high = split.get("head_range", [split["head_layers"]] * 2)
    randomised = f"; each session picks its split k in {low}..{high}" if high > low else ""
    print(
        f"prepared {manifest['model_id']}: local layers [0, {high}) + "
        f"[{split['cloud_layers'][1]}, {split['num_layers']}), cloud layers [{split['cloud_layers'][0]}, "
        f"{split['cloud_layers'][1]}){randomised}, {manifest['dtype']}\n  {out / 'local'}\n  {out / 'cloud'}"
    )
    return 0


def cmd_serve(args) -> int:
    from .cloud.security import exposure_problem, load_server_tokens, server_ssl_context
    from .cloud.server import CloudServer, ServerConfig
    from .cloud.sessions import SessionConfig
    from .model.shards import load_cloud

    if bool(args.tls_cert) != bool(args.tls_key):
        raise SplitInferError("give --tls-cert and --tls-key together.")
    if args.client_ca and not args.tls_cert:
        raise SplitInferError("--client-ca needs TLS; give --tls-cert and --tls-key too.")
    if args.max_sessions_per_token is not None and args.max_sessions_per_token < 1:
        raise SplitInferError("--max-sessions-per-token must be at least 1.")
    tokens = load_server_tokens(args.token_file)
    if args.tls_cert:
        server_ssl_context(args.tls_cert, args.tls_key, args.client_ca)  # fail now, not at the first client
    problem = exposure_problem(args.host, tokens, bool(args.tls_cert))
    if problem and not args.insecure:
        raise SplitInferError(problem)
    _threads(args)
    from .cloud.scheduler import BatchConfig

    try:  # fail before loading the shard
        batching = BatchConfig(window_ms=args.batch_window_ms, max_batch=args.max_batch)
    except ValueError as exc:
        raise SplitInferError(f"--batch-window-ms / --max-batch: {exc}") from exc
    if (args.kv_budget_mb is not None and args.kv_budget_mb <= 0) or args.evict_idle_s < 0:
        raise SplitInferError("--kv-budget-mb must be positive (or left out) and --evict-idle-s not negative.")
    half = load_cloud(args.shard, device="cpu" if args.devices else args.device, dtype=args.dtype)
    if args.devices:  # several GPUs of this node: layers placed by memory (model/placement.py)
        from .model.placement import parse_devices, spread

        device_map = spread(half.stack, parse_devices(args.devices), next(half.stack.parameters()).dtype)
        logging.getLogger("splitinfer.cloud").info("layer placement: %s", device_map)
    sessions = SessionConfig(
        ttl_s=args.session_ttl,
        max_sessions=args.max_sessions,
        max_cached_tokens=args.max_cached_tokens,
        max_message_bytes=args.max_message_mb * 1024 * 1024,
        max_kv_bytes=int(args.kv_budget_mb * 1024 * 1024) if args.kv_budget_mb else None,
        evict_idle_s=args.evict_idle_s,
        max_sessions_per_owner=args.max_sessions_per_token,
    )
    config = ServerConfig(
        host=args.host, port=args.port, sessions=sessions, tokens=tokens,
        tls_cert=args.tls_cert, tls_key=args.tls_key, client_ca=args.client_ca, batching=batching,
    )
    if problem:
        logging.getLogger("splitinfer.cloud").warning("--insecure: %s", problem.split(":")[0])
    server = CloudServer(half, config)
    if args.metrics_port is not None:
        from .metrics import CloudMetrics, serve_metrics

        server.metrics = CloudMetrics(server.table)
        serve_metrics(server.metrics, args.metrics_host, args.metrics_port)
    asyncio.run(server.serve_forever())
    return 0


def _load_client(args):
    from .local.client import SplitClient
    from .local.session import ClientConfig

    if args.local_only:
        shards = args.shards
        if shards is None or args.model is not None:
            from .model.shards import prepare
            from .model.source import load_source

            shards = Path(tempfile.mkdtemp(prefix="splitinfer-local-"))
            prepare(load_source(args.model), shards, 1, 1, "float32")
        return SplitClient.local_only(shards, device=args.device, split_seed=args.split_seed)
    if not args.shard or not args.server:
        raise SplitInferError("give --shard (the local shard) and --server (ws://HOST:PORT), or use --local-only.")
    from .preflight import check_local_memory, check_reachable

    check_reachable(args.server)  # one clear line now rather than a failed connect after loading the model
    check_local_memory(args.shard)
    _public_weights_gate(args.shard, args.allow_public_weights)
    config = ClientConfig(wire_dtype=args.wire_dtype, prefill_chunk=args.prefill_chunk, split_seed=args.split_seed)
    return SplitClient.connect(
        args.shard, args.server, config, device=args.device, auth=client_auth_from_args(args),
        allow_public_weights=args.allow_public_weights,
    )


def _public_weights_gate(local_dir, allow: bool) -> None:
    """Refuse stock public local weights unless allowed, and then warn (docs/privacy.md)."""
    from .local.client import PUBLIC_WEIGHTS_WARNING, check_local_weights
    from .model.shards import read_manifest

    if check_local_weights(read_manifest(Path(local_dir), "local"), allow):
        print(PUBLIC_WEIGHTS_WARNING, file=sys.stderr)


def _stats_table(stats: dict) -> str:
    med = stats["median_ms"]
    rows = [
        ("tokens/s (decode)", f"{stats['tokens_per_s']:.2f}"),
        ("generated tokens", stats["generated_tokens"]),
        ("decode steps", stats["steps"]),
        ("accepted / step (mean, max)", f"{stats['mean_accepted_per_step']:.2f}, {stats['max_accepted_per_step']}"),
        ("prefill", f"{stats['prefill_ms']:.1f} ms in {stats['prefill_messages']} message(s)"),
        ("bytes up / down", f"{stats['bytes_up']} / {stats['bytes_down']}"),
        ("median step", f"{med['step']:.2f} ms"),
        ("  round trip", f"{med['round_trip']:.2f} ms"),
        ("    network", f"{med['network']:.2f} ms"),
        ("    cloud compute", f"{med['cloud_compute']:.2f} ms"),
        ("  local compute", f"{med['local_compute']:.2f} ms"),
        ("  serialization", f"{med['serialize']:.3f} ms"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def cmd_generate(args) -> int:
    _threads(args)
    client = _load_client(args)
    stream = None if args.json else (lambda text: (sys.stdout.write(text), sys.stdout.flush()))
    from .decoding.sampling import SamplingConfig

    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p, args.seed) if args.temperature > 0 else None
    strategy = args.strategy
    if strategy == "lookahead":
        from .decoding.strategies import Lookahead, LookaheadConfig

        strategy = Lookahead(LookaheadConfig(ngram=args.ngram, candidates=args.candidates, window=args.window))
    result = client.generate(
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        chat=not args.no_chat,
        strategy=strategy,
        on_text=stream,
        sampling=sampling,
    )
    if args.json:
        print(json.dumps(result.as_dict(with_steps=args.steps)))
    else:
        print(f"\n\n[{result.finish_reason}] {client.mode}, {result.stats['strategy']}")
        print(_stats_table(result.stats))
    return 0


def cmd_wan(args) -> int:
    from .netem import WanConfig, run_wan

    host, _, port = args.upstream.rpartition(":")
    if not host or not port.isdigit():
        raise SplitInferError("--upstream must be HOST:PORT, e.g. 127.0.0.1:8765.")
    try:
        config = WanConfig(
            rtt_ms=args.rtt_ms, jitter_ms=args.jitter_ms, bandwidth_mbit=args.bandwidth_mbit, seed=args.seed,
            cut_after_bytes=args.cut_after_bytes, cut_after_s=args.cut_after_s, cut_connections=args.cut_connections,
            spike_ms=args.spike_ms, spike_prob=args.spike_prob, spike_count=args.spike_count,
        )
    except ValueError as exc:
        raise SplitInferError(f"bad WAN option: {exc}") from exc
    run_wan(args.host, args.listen, host, int(port), config)
    return 0


def cmd_demo(args) -> int:
    from .launch import cloud_server, wan_proxy
    from .local.client import SplitClient

    shards = Path(args.shards)
    _public_weights_gate(shards / "local", args.allow_public_weights)
    print(f"starting the cloud server on loopback with {shards / 'cloud'} (middle layers only) ...", flush=True)
    with cloud_server(shards / "cloud") as (url, _proc), wan_proxy(url, args.rtt_ms) as wan_url:
        print(f"cloud at {url}, reached through an emulated WAN at {wan_url} (+{args.rtt_ms:g} ms round trip)\n")
        client = SplitClient.connect(shards / "local", wan_url, allow_public_weights=args.allow_public_weights)
        print(f"prompt: {args.prompt}\n")
        result = client.generate(
            args.prompt, max_new_tokens=args.max_new_tokens, on_text=lambda t: (sys.stdout.write(t), sys.stdout.flush())
        )
        print(f"\n\n[{result.finish_reason}] split, {result.stats['strategy']} decoding, float16 wire")
        print(_stats_table(result.stats))
    return 0


def cmd_bench_spec(args) -> int:
    from .bench.speculative import run_speculative_bench

    run_speculative_bench(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splitinfer", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    p.add_argument("--config", help="TOML configuration file (see `splitinfer config show`; precedence: "
                   "command line > SPLITINFER_<COMMAND>_<OPTION> > file > defaults)")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("prepare", help="convert a model once into a local shard and a cloud shard")
    s.add_argument("--out", required=True, help="output directory; OUT/local and OUT/cloud are written")
    s.add_argument("--model", help="HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    s.add_argument("--head-layers", type=int, default=2, help="decoder layers kept local before the cloud (k)")
    s.add_argument("--split-range", metavar="K1-K2",
                   help="split-point randomisation instead of --head-layers: each session runs k in [K1, K2] head "
                        "layers, drawn at random; the local shard holds layers [0, K2), the cloud [K1, N-m)")
    s.add_argument("--tail-layers", type=int, default=2, help="decoder layers kept local after the cloud (m)")
    s.add_argument("--dtype", choices=DTYPE_CHOICES, default="float32", help="weights' dtype in the shards")
    s.set_defaults(func=cmd_prepare)

    s = sub.add_parser("serve", help="serve the middle layers (the untrusted side)")
    s.add_argument("--shard", required=True, help="the cloud shard directory (OUT/cloud)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8765)
    s.add_argument("--session-ttl", type=float, default=300.0, help="seconds an idle session keeps its cache")
    s.add_argument("--max-sessions", type=int, default=64)
    s.add_argument("--max-cached-tokens", type=int, default=262_144, help="KV rows over all sessions")
    s.add_argument("--max-message-mb", type=int, default=16, help="largest accepted message, MiB")
    s.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ...")
    s.add_argument("--devices", help="spread the layers over several GPUs by memory: cuda:0,cuda:1 or auto")
    s.add_argument("--dtype", choices=DTYPE_CHOICES, help="compute dtype (default: the shard's; GPUs: float16/bfloat16)")
    s.add_argument("--threads", type=int, help="torch intra-op threads")
    s.add_argument("--batch-window-ms", type=float, default=2.0,
                   help="longest wait to batch concurrent sessions' steps (never spent by a lone session)")
    s.add_argument("--max-batch", type=int, default=64, help="steps per batched pass (1: one session at a time)")
    s.add_argument("--kv-budget-mb", type=float, help="KV cache memory over all sessions, MiB (idle sessions are evicted first)")
    s.add_argument("--evict-idle-s", type=float, default=2.0, help="a session idle this long may be evicted for room")
    s.add_argument("--token-file", help="accepted bearer tokens, one per line (or set SPLITINFER_SERVER_TOKENS)")
    s.add_argument("--tls-cert", help="PEM certificate chain; with --tls-key, serve wss://")
    s.add_argument("--tls-key", help="PEM private key of --tls-cert")
    s.add_argument("--client-ca", help="require client certificates signed by this PEM CA (mutual TLS)")
    s.add_argument("--metrics-port", type=int, help="serve Prometheus metrics at http://METRICS_HOST:PORT/metrics")
    s.add_argument("--metrics-host", default="127.0.0.1", help="interface for --metrics-port (default loopback)")
    s.add_argument("--max-sessions-per-token", type=int, help="sessions one client token may hold at once")
    s.add_argument("--insecure", action="store_true",
                   help="serve a non-loopback address without tokens or TLS (only on a trusted network)")
    s.set_defaults(func=cmd_serve)

    s = sub.add_parser("generate", help="generate text; tokens never leave this machine")
    s.add_argument("--shard", help="the local shard directory (OUT/local)")
    s.add_argument("--server", help="ws://HOST:PORT of `splitinfer serve` (or of a `splitinfer wan` in front of it)")
    s.add_argument("--prompt", required=True)
    s.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    s.add_argument("--max-new-tokens", type=int, default=128)
    s.add_argument("--strategy", default="tree", choices=("tree", "sequential", "lookahead", "jacobi"),
                   help="decoding strategy; all give the same greedy output (default: tree)")
    s.add_argument("--ngram", type=int, default=5, help="lookahead: n-gram size N")
    s.add_argument("--candidates", type=int, default=5, help="lookahead: candidates G verified per step")
    s.add_argument("--window", type=int, default=0, help="lookahead: Jacobi lookahead window W (0: off)")
    s.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy; > 0 samples")
    s.add_argument("--top-k", type=int, default=0, help="with sampling: keep the k most likely tokens")
    s.add_argument("--top-p", type=float, default=1.0, help="with sampling: nucleus mass")
    s.add_argument("--seed", type=int, help="with sampling: random seed")
    s.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    s.add_argument("--steps", action="store_true", help="with --json, include per-step telemetry")
    s.add_argument("--wire-dtype", choices=DTYPE_CHOICES, default="float16")
    s.add_argument("--prefill-chunk", type=int, default=512, help="prompt rows per message")
    s.add_argument("--split-seed", type=int,
                   help="with a --split-range shard: seed the per-session split draw (tests/benchmarks only; "
                        "default: the OS's secret RNG)")
    s.add_argument("--local-only", action="store_true", help="run the whole model here, for comparison")
    s.add_argument("--shards", help="with --local-only: a prepared OUT directory")
    s.add_argument("--model", help="with --local-only: a HF directory or .gguf file (default: the embedded model)")
    s.add_argument("--device", default="cpu")
    s.add_argument("--threads", type=int, help="torch intra-op threads")
    add_client_auth_args(s)
    s.add_argument("--allow-public-weights", action="store_true",
                   help="run even though the local layers are the stock public weights (the cloud can invert them)")
    s.set_defaults(func=cmd_generate)

    s = sub.add_parser("wan", help="a user-space WAN emulator (TCP proxy adding delay, jitter, bandwidth limit)")
    s.add_argument("--listen", type=int, required=True, help="port to listen on")
    s.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    s.add_argument("--upstream", required=True, help="HOST:PORT of the server")
    s.add_argument("--rtt-ms", type=float, default=80.0, help="added round trip, split over both directions")
    s.add_argument("--jitter-ms", type=float, default=0.0)
    s.add_argument("--bandwidth-mbit", type=float, help="per-direction bandwidth limit")
    s.add_argument("--seed", type=int, help="seed for reproducible jitter and spikes")
    s.add_argument("--cut-after-bytes", type=int, help="fault: reset a connection after it relayed this many bytes")
    s.add_argument("--cut-after-s", type=float, help="fault: reset a connection this many seconds after it opened")
    s.add_argument("--cut-connections", type=int, help="fault: cut only the first K connections")
    s.add_argument("--spike-ms", type=float, default=0.0, help="fault: extra one-way delay of a spike")
    s.add_argument("--spike-prob", type=float, default=0.0, help="fault: probability a chunk is hit by a spike")
    s.add_argument("--spike-count", type=int, help="fault: at most this many spikes per direction")
    s.set_defaults(func=cmd_wan)

    s = sub.add_parser("demo", help="serve + emulated WAN + generate, on loopback")
    s.add_argument("--shards", default="shards/smollm2")
    s.add_argument("--rtt-ms", type=float, default=80.0)
    s.add_argument("--max-new-tokens", type=int, default=96)
    s.add_argument("--prompt", default="Explain in three sentences why the round trip dominates split inference over a WAN.")
    s.add_argument("--allow-public-weights", action="store_true",
                   help="run even though the local layers are the stock public weights (the cloud can invert them)")
    s.set_defaults(func=cmd_demo)

    s = sub.add_parser("bench-spec", help="speculative strategies vs sequential: accepted tokens per step, tok/s")
    s.add_argument("--shards", default="shards/smollm2")
    s.add_argument("--out", default="bench-out", help="directory for speculative.json and speculative.md")
    s.add_argument("--prompts", help="JSONL prompt file (default: the packaged benchmark prompts)")
    s.add_argument("--strategies", default="sequential,lookahead,tree")
    s.add_argument("--rtt-ms", default="0,80", help="comma-separated added round trips")
    s.add_argument("--max-new-tokens", type=int, default=128)
    s.add_argument("--repeats", type=int, default=2)
    s.add_argument("--per-category", type=int, default=3, help="prompts taken from each category")
    s.add_argument("--wire-dtype", choices=DTYPE_CHOICES, default="float16", help="Gemma needs float32 or bfloat16")
    s.set_defaults(func=cmd_bench_spec)

    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    from .configfile import apply_config

    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        # File and environment values become the subcommands' defaults, so the command line still wins.
        report = apply_config(parser, argv)
    except SplitInferError as exc:
        print(f"splitinfer: error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    args.config_report = report
    logging.basicConfig(
        level=logging.INFO if args.verbose or args.command in ("serve", "wan") else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        return args.func(args)
    except SplitInferError as exc:
        print(f"splitinfer: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
