"""`splitinfer generate` and the one client loader: a SplitClient over a server, or with the middle here.

The split path is local/ alone (`local.commands.connect_client`); the local-only path runs a cloud piece
in this process (inprocess.py). Choosing between them needs both, so it lives here, above local/ and
cloud/, which never import each other. `load_client` turns the options of `add_client_options` into a
client (generate, chat, api); `open_client` is the same loader for Python callers (benchmarks). Nothing
heavy is imported at module level.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from .local.auth import ClientAuth, client_auth_from_args
from .local.commands import (
    CLIENT_OPTIONS, LOOKAHEAD_OPTIONS, add_client_options, add_sampling_options, connect_client, sampling_from_args,
    stats_table,
)
from .options import Opt, add_options, config_from_args, defer


def open_client(
    *,
    shard: str | Path | None = None,
    server: str | list[str] | None = None,
    local_only: bool = False,
    shards: str | Path | None = None,
    model: str | None = None,
    config=None,
    device: str = "cpu",
    auth: ClientAuth = ClientAuth(),
    allow_public_weights: bool = False,
    handshake: bool = False,
):
    """A SplitClient: split (`shard` + `server`, one URL or a list) or `local_only` (`shards`, else `model` prepared into a
    temporary directory). `handshake` opens one cloud session now, so a wrong shard or refused credentials
    fail at start-up rather than at the first request."""
    from .local.session import ClientConfig

    config = config or ClientConfig()
    if local_only:
        from .inprocess import open_local_only

        return open_local_only(shards, model, device=device, split_seed=config.split_seed, drafter=config.drafter)
    return connect_client(shard, server, config, device=device, auth=auth, allow_public_weights=allow_public_weights,
                          handshake=handshake)


def load_client(args: argparse.Namespace, handshake: bool = False):
    """The SplitClient that the options of `add_client_options` describe."""
    from .local.session import ClientConfig
    from .model.synthetic import refuse_synthetic

    command = getattr(args, "command", None) or "generate"
    refuse_synthetic(args.shard, command)  # random weights: noise for text (benchmarks use open_client)
    refuse_synthetic(Path(args.shards) / "local" if args.shards else None, command)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    return open_client(
        shard=args.shard, server=args.server, local_only=args.local_only, shards=args.shards, model=args.model,
        config=config_from_args(ClientConfig, args, CLIENT_OPTIONS), device=args.device,
        auth=client_auth_from_args(args), allow_public_weights=args.allow_public_weights, handshake=handshake,
    )


def cmd_generate(args) -> int:
    sampling = sampling_from_args(args)  # option mistakes end here, before the model loads
    strategy = args.strategy
    if strategy == "lookahead":
        from .decoding.strategies import Lookahead, LookaheadConfig

        strategy = Lookahead(config_from_args(LookaheadConfig, args, LOOKAHEAD_OPTIONS))
    client = load_client(args)
    stream = None if args.json else (lambda text: (sys.stdout.write(text), sys.stdout.flush()))
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
        print(stats_table(result.stats))
    return 0


def _generate_options(s: argparse.ArgumentParser) -> None:
    from .decoding.strategies import LookaheadConfig

    add_client_options(s)
    add_options(s, LookaheadConfig, LOOKAHEAD_OPTIONS)
    add_sampling_options(s)
    s.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    s.add_argument("--steps", action="store_true", help="with --json, include per-step telemetry")


@dataclass(frozen=True)
class GenerateOptions:
    """The defaults of `splitinfer generate` beyond the client's (local/commands.py)."""

    max_new_tokens: int = 128  # tokens to generate


def register(subparsers) -> None:
    s = subparsers.add_parser("generate", help="generate text; tokens never leave this machine")
    s.add_argument("--prompt", required=True)
    s.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    add_options(s, GenerateOptions, (Opt("max_new_tokens"),))
    defer(s, _generate_options)
    s.set_defaults(func=cmd_generate)
