"""What every client command shares: its options, the split path's start-up checks, the stats table.

`add_client_options` gives generate, chat and api the same way to name a model (a local shard and a
server, or --local-only); `check_servers` is the split path's cheap check of its servers that ends in one
clear line. Making the client (split, or local-only with a cloud piece in this process), and the public-weights
gate on the manifest its load read, are clients.py's job (`open_client`, the one factory), above local/ and
cloud/. Options that mirror ClientConfig, SamplingConfig and LookaheadConfig are derived from them (options.py);
the options several commands share, with their help, come from options.py. Nothing heavy is imported at
module level.
"""

from __future__ import annotations

import argparse

from ..configfile import Repeated
from ..errors import TransportError
from ..options import ALLOW_PUBLIC_WEIGHTS, DEVICE, THREADS, Opt, Shared, add_options, config_from_args
from ..wire.dtypes import DTYPE_NAMES
from .auth import add_client_auth_args


def in_flight_option(value: str) -> int:
    """--in-flight: 1-3 pins the blocks in flight; auto (ClientConfig's AUTO_IN_FLIGHT) lets the controller choose."""
    from .config import AUTO_IN_FLIGHT, MAX_IN_FLIGHT

    if value.strip().lower() == "auto":
        return AUTO_IN_FLIGHT
    if value.strip() not in [str(d) for d in range(1, MAX_IN_FLIGHT + 1)]:
        raise argparse.ArgumentTypeError(f"takes 1 to {MAX_IN_FLIGHT} or auto, not {value!r}")
    return int(value)


CLIENT_OPTIONS = (
    Opt("wire_dtype", choices=DTYPE_NAMES, help="dtype of the hidden states on the wire (default: the one the local shard "
                                                "records: bfloat16 for Gemma 3, float16 otherwise)"),
    Opt("prefill_chunk", help="prompt rows per message"),
    Opt("split_seed", help="with a --split-range shard: seed the per-session split draw (tests/benchmarks only; "
                           "default: the OS's secret RNG)"),
    Opt("drafter", choices=("auto", "off"), help="the learned draft head in the local shard's drafter/ directory: "
                                                 "auto uses it when present and made for this model"),
    Opt("in_flight", type=in_flight_option,
        help="blocks in flight at once: 2 or 3 send the next block before the previous one's result is back "
             "(needs a v3 server; else 1); auto sends each block ahead, up to 3, when measured costs say it pays; "
             "with a draft head, 2 or more (or auto) draft the next tree while a block is out"),
    Opt("pad_rows", help="pad every step and reply to multiples of this many rows, so message sizes do not show "
                         "block sizes or accepted drafts (docs/privacy.md, T6); 0: off"),
    Opt("pad_prompt_rows", help="pad every prompt message and its reply to multiples of this many rows instead, so "
                                "prompts shorter than it look alike on the wire (docs/privacy.md, T6); 0: as --pad-rows"),
    Opt("pad_steps", help="pad every reply's exchanges to a multiple of this many with cover exchanges, so the number "
                          "of steps a reply took does not show (docs/privacy.md, T6); 0: off"),
    Opt("pad_hold_ms", help="the server holds every step's reply until this many ms after it arrived, so pass times "
                            "do not show (docs/privacy.md, T6); 0: off"),
    Opt("pad_think_ms", help="send every step no sooner than this many ms after the previous reply, so the client's "
                             "compute does not show (with --in-flight 1; docs/privacy.md, T6); 0: off"),
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


def add_client_options(s: argparse.ArgumentParser) -> None:
    """The options naming a model and how to reach it; needs torch-importing modules, so call it deferred."""
    from ..decoding.strategies import STRATEGIES
    from .config import ClientConfig, ClientOptions

    s.add_argument("--shard", help="the local shard directory (OUT/local)")
    s.add_argument("--server", action=Repeated, help="ws://HOST:PORT (or wss://) of `splitinfer serve`, or of a "
                   "`splitinfer wan` in front of it; repeat it for several servers (each session picks one by "
                   "rendezvous hashing and moves to the next when its server is gone)")
    s.add_argument("--local-only", action="store_true", help="run the whole model here, for comparison")
    s.add_argument("--shards", help="with --local-only: a prepared OUT directory")
    s.add_argument("--model", help="with --local-only: a HF directory or .gguf file (default: the embedded model)")
    add_options(s, ClientOptions, (Opt("strategy", choices=tuple(STRATEGIES),
                                       help="decoding strategy; all give the same greedy output (default: tree)"),))
    add_options(s, ClientConfig, CLIENT_OPTIONS)
    add_options(s, Shared, (DEVICE, THREADS))
    add_client_auth_args(s)
    add_options(s, Shared, (ALLOW_PUBLIC_WEIGHTS,))


def add_sampling_options(s: argparse.ArgumentParser) -> None:
    from ..decoding.sampling import SamplingConfig

    add_options(s, SamplingConfig, SAMPLING_OPTIONS)


def sampling_from_args(args: argparse.Namespace):
    """None (greedy) at temperature 0, else the SamplingConfig the options give (checked there)."""
    from ..decoding.sampling import SamplingConfig

    return None if args.temperature == 0 else config_from_args(SamplingConfig, args, SAMPLING_OPTIONS)


def check_servers(servers: str | list[str], check_reachable) -> None:
    """Every URL well formed, and at least one server reachable: the others may be down for now, since
    sessions move past a server that is gone."""
    from .failover import server_list

    unreachable: list[TransportError] = []
    urls = server_list(servers)
    for url in urls:
        try:
            check_reachable(url)
        except TransportError as exc:
            unreachable.append(exc)
    if len(unreachable) == len(urls):
        raise unreachable[0]


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
