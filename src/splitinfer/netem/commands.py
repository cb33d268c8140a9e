"""`splitinfer wan`: run the user-space WAN emulator (proxy.py) in front of a server.

Every emulation option mirrors a WanConfig field and takes its default from there (options.py), except
the added round trip, which defaults to the 80 ms this project measures at. No torch is imported.
"""

from __future__ import annotations

import argparse

from ..errors import ConfigError
from ..options import HOST, Opt, Shared, add_options, config_from_args
from .proxy import WanConfig, run_wan

WAN_RTT_MS = 80.0  # the round trip the benchmarks and the demo emulate by default

WAN_OPTIONS = (
    Opt("rtt_ms", default=WAN_RTT_MS, help="added round trip, split over both directions"),
    Opt("jitter_ms", help="uniform +/- jitter per chunk and direction"),
    Opt("bandwidth_mbit", help="per-direction bandwidth limit"),
    Opt("seed", help="seed for reproducible jitter and spikes"),
    Opt("cut_after_bytes", help="fault: reset a connection after it relayed this many bytes"),
    Opt("cut_after_s", help="fault: reset a connection this many seconds after it opened"),
    Opt("cut_connections", help="fault: cut only the first K connections"),
    Opt("spike_ms", help="fault: extra one-way delay of a spike"),
    Opt("spike_prob", help="fault: probability a chunk is hit by a spike"),
    Opt("spike_count", help="fault: at most this many spikes per direction"),
)


def cmd_wan(args: argparse.Namespace) -> int:
    host, _, port = args.upstream.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError("--upstream must be HOST:PORT, e.g. 127.0.0.1:8765.")
    run_wan(args.host, args.listen, host, int(port), config_from_args(WanConfig, args, WAN_OPTIONS))
    return 0


def register(subparsers) -> None:
    s = subparsers.add_parser("wan", help="a user-space WAN emulator (TCP proxy adding delay, jitter, bandwidth limit)")
    s.add_argument("--listen", type=int, required=True, help="port to listen on")
    add_options(s, Shared, (HOST,))
    s.add_argument("--upstream", required=True, help="HOST:PORT of the server")
    add_options(s, WanConfig, WAN_OPTIONS)
    s.set_defaults(func=cmd_wan)
