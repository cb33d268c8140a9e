"""The one CLI: a thin dispatcher over the commands, each registered beside the code it drives.

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
    splitinfer bench-acceptance --shards shards/smollm2 [--out DIR]   (acceptance by draft depth, category, source)
    splitinfer build-recycling --shards shards/smollm2 --out DIR   (warm-start table for Token Recycling)
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from .errors import SplitInferError
from .options import CommandParser

# Every command lives beside the code it drives: each module has `register(subparsers)`, which adds its
# parsers with `set_defaults(func=...)`. A module imports nothing heavy (torch) at module level; options
# that need such imports are added with `options.defer`, when their command is used.
COMMAND_MODULES: tuple[str, ...] = (
    "splitinfer.model.commands",  # prepare
    "splitinfer.cloud.commands",  # serve
    "splitinfer.clients",  # generate
    "splitinfer.netem.commands",  # wan
    "splitinfer.launch",  # demo
    "splitinfer.api.commands",  # api, chat
    "splitinfer.configfile",  # config
    "splitinfer.bench.commands",  # bench, probe, plan, bench-spec
    "splitinfer.bench.batching",  # bench-batch
    "splitinfer.bench.acceptance",  # bench-acceptance
    "splitinfer.bench.loadtest",  # load-test
    "splitinfer.privacy.commands",  # audit, privatize
    "splitinfer.recycling",  # build-recycling
    "splitinfer.drafter.commands",  # train-drafter
)
# Commands whose progress is their output, so they log at INFO without -v.
LOUD_COMMANDS = ("serve", "wan")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splitinfer", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    p.add_argument("--config", help="TOML configuration file (see `splitinfer config show`; precedence: "
                   "command line > SPLITINFER_<COMMAND>_<OPTION> > file > defaults)")
    sub = p.add_subparsers(dest="command", required=True, parser_class=CommandParser)
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
    args.argv = argv  # the command line itself, for commands that start copies of themselves (serve --tp)
    logging.basicConfig(
        level=logging.INFO if args.verbose or args.command in LOUD_COMMANDS else logging.WARNING,
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
