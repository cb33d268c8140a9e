"""`splitinfer api` and `splitinfer chat`: the client-side commands of this package (registered by cli.py).

Nothing heavy is imported at module level; torch and the model load inside the command functions.
"""

from __future__ import annotations

import argparse
import logging
import sys

from ..allocator import settle_long_running
from ..errors import ConfigError
from ..tokens import read_token_file
from ..clients import load_client
from ..local.commands import add_client_options, add_sampling_options, sampling_from_args
from ..options import HOST, Opt, Shared, add_options, defer
from .config import ApiOptions

log = logging.getLogger("splitinfer.api")

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _api_options(s: argparse.ArgumentParser) -> None:
    add_client_options(s)
    add_options(s, Shared, (HOST,))
    s.add_argument("--api-key-file", help="accepted API keys, one per line; requests must send one as the bearer token")
    add_options(s, ApiOptions, (Opt("port"),))
    s.add_argument("--model-name", help="model id the API answers to (default: the shard's model id)")
    add_options(s, ApiOptions, (
        Opt("max_concurrent", help="requests generating at once; more wait"),
        Opt("max_queued", help="requests waiting beyond --max-concurrent; more get 429"),
        Opt("max_new_tokens", "--default-max-tokens", help="max_tokens when a request gives none"),
    ))
    _memory_option(s)


def _chat_options(s: argparse.ArgumentParser) -> None:
    add_client_options(s)
    s.add_argument("--system", help="system prompt")
    add_options(s, ApiOptions, (Opt("max_new_tokens"),))
    add_sampling_options(s)
    _memory_option(s)


def _memory_option(s: argparse.ArgumentParser) -> None:
    from ..decoding.warm import SUFFIX_MEMORY_TOKENS

    s.add_argument("--memory-tokens", type=int, default=SUFFIX_MEMORY_TOKENS,
                   help="earlier replies kept in this process for drafting (tokens; 0 keeps none)")


def register(subparsers) -> None:
    s = subparsers.add_parser("api", help="an OpenAI-compatible HTTP API on this machine (/v1/chat/completions ...)")
    defer(s, _api_options)
    s.set_defaults(func=cmd_api)

    s = subparsers.add_parser("chat", help="interactive chat in the terminal; later turns reuse the KV cache")
    defer(s, _chat_options)
    s.set_defaults(func=cmd_chat)


def cmd_api(args) -> int:
    settle_long_running()  # memory flat over days: mmap threshold, kernel caches capped (allocator.py)
    from ..extras import API, require_extra

    require_extra("api", API, "splitinfer api")
    from ..metrics import LocalMetrics
    from .app import ApiLimits
    from .engine import Engine
    from .server import ApiServer

    if args.max_concurrent < 1 or args.default_max_tokens < 1 or args.max_queued < 0 or args.memory_tokens < 0:
        raise ConfigError("--max-concurrent and --default-max-tokens must be at least 1, --max-queued and "
                          "--memory-tokens at least 0.")
    keys = tuple(read_token_file(args.api_key_file)) if args.api_key_file else ()
    if args.host not in LOOPBACK and not keys:
        log.warning("binding the API to %s without --api-key-file: anyone who can reach it can use the model", args.host)
    client = load_client(args, handshake=True)
    model_id = args.model_name or client.local.manifest.get("model_id", "splitinfer")
    engine = Engine(client, model_id, LocalMetrics(), args.strategy, args.max_concurrent, args.default_max_tokens,
                    args.memory_tokens)
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
    from .chat import ChatSession, run_chat

    sampling = sampling_from_args(args)  # option mistakes end here, before the model loads
    if args.memory_tokens < 0:
        raise ConfigError("--memory-tokens must be at least 0 (0 keeps no earlier replies).")
    client = load_client(args, handshake=True)
    chat = ChatSession(client, args.system, args.strategy, memory_tokens=args.memory_tokens)
    try:
        if sys.stdin.isatty():
            import readline  # noqa: F401 - line editing and history for input()
        return run_chat(chat, args.max_new_tokens, sampling)
    finally:
        chat.close()
