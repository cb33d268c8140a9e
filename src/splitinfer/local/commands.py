"""`splitinfer generate`, and what every client command shares: its options and the one client loader.

`add_client_options` gives generate, chat and api the same way to name a model (a local shard and a
server, or --local-only), and `load_client` turns those options into a SplitClient after the cheap
checks that end in one clear line. `open_client` is the same loader for Python callers (benchmarks).
Options that mirror ClientConfig, SamplingConfig and LookaheadConfig are derived from them (options.py).
Nothing heavy is imported at module level.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from ..errors import ConfigError
from ..options import Opt, add_options, config_from_args, defer
from ..wire.dtypes import DTYPE_NAMES
from .auth import ClientAuth, add_client_auth_args, client_auth_from_args

CLIENT_OPTIONS = (
    Opt("wire_dtype", choices=DTYPE_NAMES, help="dtype of the hidden states on the wire"),
    Opt("prefill_chunk", help="prompt rows per message"),
    Opt("split_seed", help="with a --split-range shard: seed the per-session split draw (tests/benchmarks only; "
                           "default: the OS's secret RNG)"),
    Opt("drafter", choices=("auto", "off"), help="the learned draft head in the local shard's drafter/ directory: "
                                                 "auto uses it when present and made for this model"),
)
# 0 (greedy) is the command line's default temperature; SamplingConfig is only built when sampling.
SAMPLING_OPTIONS = (
    Opt("temperature", default=0.0, help="0 (default) is greedy; > 0 samples"),
    Opt("top_k", help="with sampling: keep the k most likely tokens"),
    Opt("top_p", help="with sampling: nucleus mass"),
    Opt("seed", help="with sampling: random seed"),
)
LOOKAHEAD_OPTIONS = (
    Opt("ngram", help="lookahead: n-gram size N"),
    Opt("candidates", help="lookahead: candidates G verified per step"),
    Opt("window", help="lookahead: Jacobi lookahead window W (0: off)"),
)
ALLOW_PUBLIC_HELP = "run even though the local layers are the stock public weights (the cloud can invert them)"


def add_client_options(s: argparse.ArgumentParser) -> None:
    """The options naming a model and how to reach it; needs torch-importing modules, so call it deferred."""
    from ..decoding.strategies import STRATEGIES
    from .session import ClientConfig

    s.add_argument("--shard", help="the local shard directory (OUT/local)")
    s.add_argument("--server", help="ws://HOST:PORT (or wss://) of `splitinfer serve`, or of a `splitinfer wan` "
                   "in front of it")
    s.add_argument("--local-only", action="store_true", help="run the whole model here, for comparison")
    s.add_argument("--shards", help="with --local-only: a prepared OUT directory")
    s.add_argument("--model", help="with --local-only: a HF directory or .gguf file (default: the embedded model)")
    s.add_argument("--strategy", default="tree", choices=tuple(STRATEGIES),
                   help="decoding strategy; all give the same greedy output (default: tree)")
    add_options(s, ClientConfig, CLIENT_OPTIONS)
    s.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ...")
    s.add_argument("--threads", type=int, help="torch intra-op threads")
    add_client_auth_args(s)
    s.add_argument("--allow-public-weights", action="store_true", help=ALLOW_PUBLIC_HELP)


def add_sampling_options(s: argparse.ArgumentParser) -> None:
    from ..decoding.sampling import SamplingConfig

    add_options(s, SamplingConfig, SAMPLING_OPTIONS)


def sampling_from_args(args: argparse.Namespace):
    """None (greedy) at temperature 0, else the SamplingConfig the options give (checked there)."""
    from ..decoding.sampling import SamplingConfig

    return None if args.temperature == 0 else config_from_args(SamplingConfig, args, SAMPLING_OPTIONS)


def public_weights_gate(local_dir: str | Path, allow: bool) -> None:
    """Refuse stock public local weights unless allowed, and then warn (docs/privacy.md)."""
    from ..model.shards import read_manifest
    from .client import PUBLIC_WEIGHTS_WARNING, check_local_weights

    if check_local_weights(read_manifest(Path(local_dir), "local"), allow):
        print(PUBLIC_WEIGHTS_WARNING, file=sys.stderr)


def open_client(
    *,
    shard: str | Path | None = None,
    server: str | None = None,
    local_only: bool = False,
    shards: str | Path | None = None,
    model: str | None = None,
    config=None,
    device: str = "cpu",
    auth: ClientAuth = ClientAuth(),
    allow_public_weights: bool = False,
    handshake: bool = False,
):
    """A SplitClient: split (`shard` + `server`) or `local_only` (`shards`, else `model` prepared into a
    temporary directory). `handshake` opens one cloud session now, so a wrong shard or refused credentials
    fail at start-up rather than at the first request."""
    from ..preflight import check_handshake, check_local_memory, check_reachable
    from .client import SplitClient
    from .session import ClientConfig

    config = config or ClientConfig()
    if local_only:
        if shards is None or model is not None:
            from ..extras import GGUF, is_gguf_source, require_extra

            if is_gguf_source(model):
                require_extra("gguf", GGUF, "--local-only (reading a GGUF model; the default is one)")
            from ..model.shards import prepare
            from ..model.source import load_source

            shards = Path(tempfile.mkdtemp(prefix="splitinfer-local-"))
            prepare(load_source(model), shards, 1, 1, "float32")
        check_local_memory(Path(shards) / "local")
        return SplitClient.local_only(shards, device=device, split_seed=config.split_seed, drafter=config.drafter)
    if not shard or not server:
        raise ConfigError("give --shard (the local shard) and --server (ws://HOST:PORT), or use --local-only.")
    check_reachable(server)  # one clear line now rather than a failed connect after loading the model
    check_local_memory(shard)
    public_weights_gate(shard, allow_public_weights)
    client = SplitClient.connect(shard, server, config, device=device, auth=auth,
                                 allow_public_weights=allow_public_weights)
    if handshake:
        check_handshake(client)
    return client


def load_client(args: argparse.Namespace, handshake: bool = False):
    """The SplitClient that the options of `add_client_options` describe."""
    from .session import ClientConfig

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    return open_client(
        shard=args.shard, server=args.server, local_only=args.local_only, shards=args.shards, model=args.model,
        config=config_from_args(ClientConfig, args, CLIENT_OPTIONS), device=args.device,
        auth=client_auth_from_args(args), allow_public_weights=args.allow_public_weights, handshake=handshake,
    )


def stats_table(stats: dict) -> str:
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
    sampling = sampling_from_args(args)  # option mistakes end here, before the model loads
    strategy = args.strategy
    if strategy == "lookahead":
        from ..decoding.strategies import Lookahead, LookaheadConfig

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
    from ..decoding.strategies import LookaheadConfig

    add_client_options(s)
    add_options(s, LookaheadConfig, LOOKAHEAD_OPTIONS)
    add_sampling_options(s)
    s.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    s.add_argument("--steps", action="store_true", help="with --json, include per-step telemetry")


def register(subparsers) -> None:
    s = subparsers.add_parser("generate", help="generate text; tokens never leave this machine")
    s.add_argument("--prompt", required=True)
    s.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    s.add_argument("--max-new-tokens", type=int, default=128)
    defer(s, _generate_options)
    s.set_defaults(func=cmd_generate)
