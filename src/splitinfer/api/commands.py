"""`splitinfer api` and `splitinfer chat`: the client-side commands of this package (registered by cli.py).

Nothing heavy is imported at module level; torch and the model load inside the command functions.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from ..errors import ConfigError
from ..local.auth import add_client_auth_args, client_auth_from_args, read_token_file

log = logging.getLogger("splitinfer.api")

DTYPES = ("float32", "float16", "bfloat16")
STRATEGY_CHOICES = ("tree", "sequential", "lookahead", "jacobi")
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _client_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--shard", help="the local shard directory (OUT/local)")
    s.add_argument("--server", help="ws://HOST:PORT (or wss://) of `splitinfer serve`")
    s.add_argument("--local-only", action="store_true", help="run the whole model here (--shards OUT), for comparison")
    s.add_argument("--shards", help="with --local-only: a prepared OUT directory")
    s.add_argument("--strategy", default="tree", choices=STRATEGY_CHOICES, help="decoding strategy (default: tree)")
    s.add_argument("--wire-dtype", choices=DTYPES, default="float16")
    s.add_argument("--prefill-chunk", type=int, default=512, help="prompt rows per message")
    s.add_argument("--device", default="cpu")
    s.add_argument("--threads", type=int, help="torch intra-op threads")
    add_client_auth_args(s)
    s.add_argument("--allow-public-weights", action="store_true",
                   help="run even though the local layers are the stock public weights (the cloud can invert them)")


def register(subparsers) -> None:
    s = subparsers.add_parser("api", help="an OpenAI-compatible HTTP API on this machine (/v1/chat/completions ...)")
    _client_args(s)
    s.add_argument("--host", default="127.0.0.1", help="interface to bind (default loopback)")
    s.add_argument("--api-key-file", help="accepted API keys, one per line; requests must send one as the bearer token")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--model-name", help="model id the API answers to (default: the shard's model id)")
    s.add_argument("--max-concurrent", type=int, default=4, help="requests generating at once; more wait")
    s.add_argument("--max-queued", type=int, default=60, help="requests waiting beyond --max-concurrent; more get 429")
    s.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens when a request gives none")
    s.set_defaults(func=cmd_api)

    s = subparsers.add_parser("chat", help="interactive chat in the terminal; later turns reuse the KV cache")
    _client_args(s)
    s.add_argument("--system", help="system prompt")
    s.add_argument("--max-new-tokens", type=int, default=256)
    s.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy; > 0 samples")
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--seed", type=int)
    s.set_defaults(func=cmd_chat)


def load_client(args):
    """The SplitClient the arguments describe, after the cheap checks that give one-line errors."""
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)
    from ..local.client import PUBLIC_WEIGHTS_WARNING, SplitClient, check_local_weights
    from ..local.session import ClientConfig
    from ..model.shards import read_manifest
    from ..preflight import check_handshake, check_local_memory, check_reachable

    if args.local_only:
        if not args.shards:
            raise ConfigError("--local-only needs --shards OUT (a directory written by `splitinfer prepare`).")
        check_local_memory(Path(args.shards) / "local")
        return SplitClient.local_only(args.shards, device=args.device)
    if not args.shard or not args.server:
        raise ConfigError("give --shard (the local shard) and --server (ws://HOST:PORT), or --local-only --shards OUT.")
    check_reachable(args.server)
    check_local_memory(args.shard)
    # The same refusal as `generate`: stock public local weights let the cloud invert what it sees.
    if check_local_weights(read_manifest(Path(args.shard), "local"), args.allow_public_weights):
        print(PUBLIC_WEIGHTS_WARNING, file=sys.stderr)
    config = ClientConfig(wire_dtype=args.wire_dtype, prefill_chunk=args.prefill_chunk)
    client = SplitClient.connect(args.shard, args.server, config, device=args.device, auth=client_auth_from_args(args),
                                 allow_public_weights=args.allow_public_weights)
    check_handshake(client)
    return client


def cmd_api(args) -> int:
    from ..extras import API, require_extra

    require_extra("api", API, "splitinfer api")
    from ..metrics import LocalMetrics
    from .app import ApiLimits
    from .engine import Engine
    from .server import ApiServer

    if args.max_concurrent < 1 or args.default_max_tokens < 1 or args.max_queued < 0:
        raise ConfigError("--max-concurrent and --default-max-tokens must be at least 1, --max-queued at least 0.")
    keys = tuple(read_token_file(args.api_key_file)) if args.api_key_file else ()
    if args.host not in LOOPBACK and not keys:
        log.warning("binding the API to %s without --api-key-file: anyone who can reach it can use the model", args.host)
    client = load_client(args)
    model_id = args.model_name or client.local.manifest.get("model_id", "splitinfer")
    engine = Engine(client, model_id, LocalMetrics(), args.strategy, args.max_concurrent, args.default_max_tokens)
    try:
        server = ApiServer(engine, args.host, args.port, keys, ApiLimits(max_pending=args.max_concurrent + args.max_queued))
    except OSError as exc:
        raise ConfigError(f"cannot listen on {args.host}:{args.port} ({exc.strerror}); pick another --port.") from exc
    print(f"OpenAI-compatible API for {model_id!r} ({client.mode}) on {server.url}  (metrics: /metrics)", flush=True)
    try:
        server.serve_forever()
    finally:
        server.close()
    return 0


def cmd_chat(args) -> int:
    from ..decoding.sampling import SamplingConfig
    from .chat import ChatSession, run_chat

    client = load_client(args)
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p, args.seed) if args.temperature > 0 else None
    chat = ChatSession(client, args.system, args.strategy)
    try:
        if sys.stdin.isatty():
            import readline  # noqa: F401 - line editing and history for input()
        return run_chat(chat, args.max_new_tokens, sampling)
    finally:
        chat.close()
