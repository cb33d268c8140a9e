"""The one client factory (`open_client`) and `splitinfer generate`.

`open_client` makes every SplitClient, of three kinds: remote (a local shard and cloud servers), in-process
(a prepared OUT directory, or halves already loaded: the middle runs here over a cloud SessionTable, no
wire) and local-only (in-process after preparing a model into a temporary directory, the `--local-only`
path). The in-process kinds compose a cloud piece with the local client, so the factory lives here, above
local/ and cloud/, which never import each other. `load_client` turns the options of `add_client_options`
into a client (generate, chat, api); every other entry point calls `open_client` (tests/test_entry_points.py
holds it). A remote client's local half is loaded once (`load_checked_local`), and every check of its manifest
reads the manifest that load read: a command reads OUT/local/manifest.json once and runs the public-weights
gate once. Nothing heavy is imported at module level.
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
    local=None,
    device: str = "cpu",
    auth: ClientAuth = ClientAuth(),
    allow_public_weights: bool = False,
    handshake: bool = False,
    checks: bool = True,
    command: str | None = None,
    wire: str | None = None,
):
    """A SplitClient; `config` a ClientConfig (default: its defaults).

    - remote: `shard` (OUT/local) and `server` (one URL or a list); its local half is `load_checked_local`'s
      (stock public local weights refused unless `allow_public_weights`), or `local`, that half already
      loaded by it (the demo loads it before starting its server). `handshake` opens one cloud session
      now, so a wrong shard or refused credentials fail at start-up rather than at the first request.
    - in-process (`local_only`): `shards` (a prepared OUT directory), or `halves` (a LocalHalf and a CloudHalf
      already loaded; `shards` then only says where the draft head is, None: none). Hidden states are handed
      over in float32 (`wire`: through that wire dtype's encoding both ways instead, as a server would receive
      and send them); of `config` only `split_seed` and `drafter` apply.
    - local-only (`local_only`, no `shards`, or a `model`): `model` (a HF directory or .gguf; None: the
      embedded model) prepared into a temporary directory first, then in-process.
    checks: the cheap start-up checks that end in one clear line (a server reachable, the local shard fits
    in memory, the public-weights warning); off for callers that test odd servers or time start-up.
    command: the text command the client serves (generate, chat, api, demo): synthetic weights, whose text
    is noise, are refused for it. None (benchmarks, which time synthetic shards) refuses none.
    """
    from .local.config import ClientConfig

    config = config or ClientConfig()
    if local_only:
        return _in_process(shards, model, halves, config, device, checks, command, wire)
    return _remote(shard, server, config, device, auth, allow_public_weights, handshake, checks, command, local)


def load_checked_local(shard: str | Path, device: str = "cpu", *, allow_public_weights: bool = False,
                       command: str | None = None, checks: bool = True, servers=None):
    """The local half of a remote client, loaded first so that its manifest is read once (by the load) and
    every check reads that manifest, the one whose file hashes the load verified: synthetic weights are
    refused for a text `command`, stock public weights unless `allow_public_weights` (the one public-weights
    gate, `check_local_weights`), and then warned about on stderr. `checks`: also refuse a shard that does
    not fit in memory, before loading it, and print the warning. `servers`: with `checks`, at least one of
    them must be reachable, checked between the two refusals (the order the commands always had)."""
    from .local.client import PUBLIC_WEIGHTS_WARNING, check_local_weights
    from .local.commands import check_servers
    from .model.shards import load_local
    from .preflight import check_local_memory, check_reachable

    if checks:
        check_local_memory(shard)
    local = load_local(shard, device=device)
    _refuse_synthetic(local.manifest, shard, command)
    if checks and servers is not None:
        check_servers(servers, check_reachable)  # one clear line before the first step
    if check_local_weights(local.manifest, allow_public_weights) and checks:
        print(PUBLIC_WEIGHTS_WARNING, file=sys.stderr)
    return local


def _refuse_synthetic(manifest: dict, shard, command: str | None) -> None:
    """Random weights (model/synthetic.py) time a step but generate noise: refused for a text command."""
    from .errors import ModelError
    from .model.synthetic import is_synthetic

    if command is None or not is_synthetic(manifest):
        return
    source = manifest.get("synthetic_source", {})
    raise ModelError(
        f"{shard} holds synthetic weights (random, in the shape of {source.get('config', '?')}, seed "
        f"{source.get('seed', '?')}): they time a step but generate noise, so `splitinfer {command}` refuses them. "
        "Use them with `splitinfer bench step` or `bench batch`; prepare a real model for text."
    )


def _remote(shard, server, config, device: str, auth: ClientAuth, allow_public_weights: bool, handshake: bool,
            checks: bool, command: str | None, local):
    from .errors import ConfigError
    from .local.client import SplitClient
    from .local.failover import server_list
    from .preflight import check_handshake, check_url

    if not shard or not server:
        raise ConfigError("give --shard (the local shard) and --server (ws://HOST:PORT), or use --local-only.")
    if checks:
        for url in server_list(server):
            check_url(url)  # a typo ends here, before anything loads
    if local is None:
        local = load_checked_local(shard, device, allow_public_weights=allow_public_weights, command=command,
                                   checks=checks, servers=server)
    client = SplitClient.remote(local, shard, server, config, device=device, auth=auth)
    if handshake:
        check_handshake(client)
    return client


def _in_process(shards, model, halves, config, device: str, checks: bool, command: str | None, wire: str | None):
    from .inprocess import InProcessMiddle, load_halves, prepare_temporary
    from .local.client import SplitClient, head_depth_drawer, load_draft_head
    from .local.config import ClientConfig
    from .preflight import check_local_memory

    def refuse_synthetic(local) -> None:
        _refuse_synthetic(local.manifest, Path(shards) / "local" if shards else "the local half", command)

    if halves is None:
        if shards is None or model is not None:
            shards = prepare_temporary(model)
        if checks:
            check_local_memory(Path(shards) / "local")
        halves = load_halves(shards, device, check=refuse_synthetic)
    else:
        refuse_synthetic(halves[0])
    local, cloud = halves
    draw = head_depth_drawer(local, config.split_seed)
    config = ClientConfig(wire_dtype=wire or "float32", split_seed=config.split_seed, drafter=config.drafter)
    head = None if shards is None else load_draft_head(local, Path(shards) / "local", config.drafter, device)
    return SplitClient(local, lambda: InProcessMiddle(cloud, draw(), wire), config, mode="local-only", draft_head=head)


def load_client(args: argparse.Namespace, handshake: bool = False):
    """The SplitClient that the options of `add_client_options` describe."""
    from .local.config import ClientConfig

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    return open_client(
        args.shard, args.server, config_from_args(ClientConfig, args, CLIENT_OPTIONS), local_only=args.local_only,
        shards=args.shards, model=args.model, device=args.device,
        auth=client_auth_from_args(args), allow_public_weights=args.allow_public_weights, handshake=handshake,
        command=getattr(args, "command", None) or "generate",
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
