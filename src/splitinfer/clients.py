"""The one client factory (`open_client`) and `splitinfer generate`.

`open_client` makes every SplitClient, of three kinds: remote (a local shard and cloud servers), in-process
(a prepared OUT directory, or halves already loaded: the middle runs here over a cloud SessionTable, no
wire) and local-only (in-process after preparing a model into a temporary directory, the `--local-only`
path). The in-process kinds compose a cloud piece with the local client, so the factory lives here, above
local/ and cloud/, which never import each other. `load_client` turns the options of `add_client_options`
into a client (generate, chat, api); every other entry point calls `open_client` (tests/test_entry_points.py
holds it). Nothing heavy is imported at module level.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .local.auth import ClientAuth, client_auth_from_args
from .local.commands import (
    CLIENT_OPTIONS, LOOKAHEAD_OPTIONS, add_client_options, add_sampling_options, sampling_from_args, stats_table,
)
from .options import Opt, add_options, config_from_args, defer


def open_client(
    shard: str | Path | None = None,
    server: str | list[str] | None = None,
    config=None,
    *,
    local_only: bool = False,
    shards: str | Path | None = None,
    model: str | None = None,
    halves=None,
    device: str = "cpu",
    auth: ClientAuth = ClientAuth(),
    allow_public_weights: bool = False,
    handshake: bool = False,
    checks: bool = True,
):
    """A SplitClient; `config` a ClientConfig (default: its defaults).

    - remote: `shard` (OUT/local) and `server` (one URL or a list); stock public local weights are refused
      unless `allow_public_weights`. `handshake` opens one cloud session now, so a wrong shard or refused
      credentials fail at start-up rather than at the first request.
    - in-process (`local_only`): `shards` (a prepared OUT directory), or `halves` (a LocalHalf and a CloudHalf
      already loaded; `shards` then only says where the draft head is, None: none). Hidden states are handed
      over in float32; of `config` only `split_seed` and `drafter` apply.
    - local-only (`local_only`, no `shards`, or a `model`): `model` (a HF directory or .gguf; None: the
      embedded model) prepared into a temporary directory first, then in-process.
    checks: the cheap start-up checks that end in one clear line (a server reachable, the local shard fits
    in memory, the public-weights warning); off for callers that test odd servers or time start-up.
    """
    from .local.config import ClientConfig

    config = config or ClientConfig()
    if local_only:
        return _in_process(shards, model, halves, config, device, checks)
    return _remote(shard, server, config, device, auth, allow_public_weights, handshake, checks)


def _remote(shard, server, config, device: str, auth: ClientAuth, allow_public_weights: bool, handshake: bool,
            checks: bool):
    from .errors import ConfigError
    from .local.client import SplitClient
    from .local.commands import check_servers, public_weights_gate
    from .preflight import check_handshake, check_local_memory, check_reachable

    if not shard or not server:
        raise ConfigError("give --shard (the local shard) and --server (ws://HOST:PORT), or use --local-only.")
    if checks:
        check_servers(server, check_reachable)  # one clear line now rather than a failed connect after loading
        check_local_memory(shard)
        public_weights_gate(shard, allow_public_weights)
    client = SplitClient.connect(shard, server, config, device=device, auth=auth,
                                 allow_public_weights=allow_public_weights)
    if handshake:
        check_handshake(client)
    return client


def _in_process(shards, model, halves, config, device: str, checks: bool):
    from .inprocess import InProcessMiddle, load_halves, prepare_temporary
    from .local.client import SplitClient, head_depth_drawer, load_draft_head
    from .local.config import ClientConfig
    from .preflight import check_local_memory

    if halves is None:
        if shards is None or model is not None:
            shards = prepare_temporary(model)
        if checks:
            check_local_memory(Path(shards) / "local")
        halves = load_halves(shards, device)
    local, cloud = halves
    draw = head_depth_drawer(local, config.split_seed)
    config = ClientConfig(wire_dtype="float32", split_seed=config.split_seed, drafter=config.drafter)
    head = None if shards is None else load_draft_head(local, Path(shards) / "local", config.drafter, device)
    return SplitClient(local, lambda: InProcessMiddle(cloud, draw()), config, mode="local-only", draft_head=head)


def load_client(args: argparse.Namespace, handshake: bool = False):
    """The SplitClient that the options of `add_client_options` describe."""
    from .local.config import ClientConfig
    from .model.synthetic import refuse_synthetic

    command = getattr(args, "command", None) or "generate"
    refuse_synthetic(args.shard, command)  # random weights: noise for text (benchmarks use open_client)
    refuse_synthetic(Path(args.shards) / "local" if args.shards else None, command)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    return open_client(
        args.shard, args.server, config_from_args(ClientConfig, args, CLIENT_OPTIONS), local_only=args.local_only,
        shards=args.shards, model=args.model, device=args.device,
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
    from .local.config import ClientOptions

    add_options(s, ClientOptions, (Opt("max_new_tokens"),))
    add_client_options(s)
    add_options(s, LookaheadConfig, LOOKAHEAD_OPTIONS)
    add_sampling_options(s)
    s.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    s.add_argument("--steps", action="store_true", help="with --json, include per-step telemetry")


def register(subparsers) -> None:
    s = subparsers.add_parser("generate", help="generate text; tokens never leave this machine")
    s.add_argument("--prompt", required=True)
    s.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    defer(s, _generate_options)
    s.set_defaults(func=cmd_generate)
