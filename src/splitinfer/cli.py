"""The one CLI: a thin dispatcher over the commands, each registered beside the code it drives.

Commands that use the model:
    prepare      convert a model once into a local and a cloud shard
    serve        the cloud half (untrusted side)
    generate     one generation; chat and api for interactive use and apps
    demo         serve + emulated WAN + generate, on loopback
    wan          a user-space WAN emulator
    config       the effective configuration
Groups, as in vLLM (`splitinfer bench --help` lists a group's commands):
    bench        sweep, spec, step, plain-split, dtype, batch, acceptance, load, soak, probe, plan, and the
                 developer benchmarks (kernels, kernel-ab, arena, compile, memory, step-ab, wan, scale, detok, ...)
    privacy      audit, privatize, check, table
    drafter      train, recycling

example: splitinfer generate --shard shards/smollm2/local --server ws://127.0.0.1:8765 --prompt "Hello" --allow-public-weights
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from . import __version__
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
    "splitinfer.kernels.commands",  # kernels
)
# Groups of commands (`splitinfer GROUP COMMAND`): name -> (help, the modules that register into it).
GROUPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "bench": ("benchmarks and sizing: sweep, spec, step, plain-split, dtype, exactness, batch, acceptance, load, soak, probe, "
              "plan; developer benchmarks: formats, kernels, kernel-ab, arena, compile, memory, step-ab, trusted-half, wan, scale, "
              "detok, drafting, project", (
        "splitinfer.bench.commands",  # sweep, probe, plan, spec
        "splitinfer.bench.step_commands",  # step, formats, kernels, kernel-ab, arena, compile, memory, step-ab, trusted-half
        "splitinfer.bench.system_commands",  # wan, scale, detok, drafting, project
        "splitinfer.bench.batching",  # batch
        "splitinfer.bench.acceptance",  # acceptance
        "splitinfer.bench.loadtest",  # load
        "splitinfer.bench.soak",  # soak
        "splitinfer.bench.plainsplit",  # plain-split
        "splitinfer.bench.dtypecheck",  # dtype
        "splitinfer.bench.exactness",  # exactness
    )),
    "privacy": ("what the cloud can recover, and the defences: audit, privatize, check, table", (
        "splitinfer.privacy.commands",  # audit, privatize, check, table
    )),
    "drafter": ("the drafting files: train (the draft head), recycling (the successor table)", (
        "splitinfer.drafter.commands",  # train
        "splitinfer.recycling",  # recycling
    )),
}
# One example line per command, shown at the end of its --help ("GROUP COMMAND" for a grouped one).
EXAMPLES: dict[str, str] = {
    "prepare": "splitinfer prepare --out shards/smollm2",
    "serve": "splitinfer serve --shard shards/smollm2/cloud --port 8765",
    "generate": 'splitinfer generate --shard shards/smollm2/local --server ws://127.0.0.1:8765 --prompt "Hello" '
                "--allow-public-weights",
    "wan": "splitinfer wan --listen 9000 --upstream 127.0.0.1:8765 --rtt-ms 80",
    "demo": "splitinfer demo --shards shards/smollm2 --rtt-ms 80 --allow-public-weights",
    "api": "splitinfer api --shard shards/smollm2/local --server ws://127.0.0.1:8765 --allow-public-weights",
    "chat": "splitinfer chat --shard shards/smollm2/local --server ws://127.0.0.1:8765 --allow-public-weights",
    "config": "splitinfer config show --command serve",
    "kernels": "splitinfer kernels --json",
    "bench": "splitinfer bench spec --shards shards/smollm2 --out bench-out --rtt-ms 0,80",
    "bench sweep": "splitinfer bench sweep --shards shards/smollm2 --out bench-out --quick",
    "bench spec": "splitinfer bench spec --shards shards/smollm2 --out bench-out --rtt-ms 0,80 --max-new-tokens 64",
    "bench step": "splitinfer bench step --shards shards/smollm2 --out bench-out/step --e2e-prompts 3 --max-ratio 1.2",
    "bench formats": "splitinfer bench formats --out bench-out/formats --prompts 5 --tokens 64",
    "bench kernels": "splitinfer bench kernels --kernel w8a8 --out bench-out/w8a8-kernel",
    "bench arena": "splitinfer bench arena --shards shards/formats/int8 --out bench-out/arena",
    "bench compile": "splitinfer bench compile --shards shards/smollm2 --out bench-out/compile --generations 1",
    "bench memory": "splitinfer bench memory --shards shards/formats/int8,shards/formats/float32 --out bench-out/memory",
    "bench step-ab": "splitinfer bench step-ab --other-src ../before/src --out bench-out/step-ab --rows 1,4,8",
    "bench trusted-half": "splitinfer bench trusted-half --out bench-out/trusted-7b --formats float32,bfloat16",
    "bench wan": "splitinfer bench wan --out bench-out/wan --rtt-ms 80",
    "bench scale": "splitinfer bench scale --shards shards/smollm2 --tp 3 --sessions 4 --out bench-out/scale --name tp3",
    "bench detok": "splitinfer bench detok --shards shards/smollm2 --out bench-out/detok",
    "bench drafting": "splitinfer bench drafting --replies notes/bench/drafting/replay.json --out bench-out/drafting",
    "bench project": "splitinfer bench project notes/bench/mtbench-spec/speculative.json --out bench-out/projection",
    "bench plain-split": "splitinfer bench plain-split --shards shards/smollm2 --out bench-out/plain --rtt-ms 0,80",
    "bench kernel-ab": "splitinfer bench kernel-ab --shards shards/smollm2 --out bench-out/kernel-ab",
    "bench dtype": "splitinfer bench dtype --shards shards/smollm2 --out bench-out/bf16 --dtype bfloat16",
    "bench exactness": "splitinfer bench exactness --out bench-out/exactness --formats 'float32;int8'",
    "bench batch": "splitinfer bench batch --shards shards/smollm2 --out bench-out/batch --sizes 1,4,16",
    "bench acceptance": "splitinfer bench acceptance --shards shards/smollm2 --out bench-out/acceptance",
    "bench load": "splitinfer bench load --shards shards/smollm2 --sessions 64 --max-sessions 48 --max-new-tokens 32",
    "bench soak": "splitinfer bench soak --shards shards/smollm2 --servers 2 --clients 8 --duration 1800 --warmup 300",
    "bench probe": "splitinfer bench probe --server wss://gpu-host:8765 --token-file token.txt --ca-file server.pem",
    "bench plan": "splitinfer bench plan --config mistral-7b-v0.1 --head-layers 2 --tail-layers 2",
    "privacy": "splitinfer privacy privatize --shards shards/smollm2 --out shards/smollm2-keyed --basis",
    "privacy audit": "splitinfer privacy audit --shards shards/smollm2 --out audit-out --quick",
    "privacy privatize": "splitinfer privacy privatize --shards shards/smollm2 --out shards/smollm2-keyed --basis",
    "privacy check": "splitinfer privacy check --public shards/smollm2 --keyed shards/smollm2-keyed --out check.json",
    "privacy table": "splitinfer privacy table --audit audit-out/audit.json --write docs/privacy.md",
    "drafter": "splitinfer drafter train --shards shards/smollm2 --out drafter-out --tokens 200000",
    "drafter train": "splitinfer drafter train --shards shards/smollm2 --out drafter-out --tokens 200000 --prompts 2400 --schedule cosine",
    "drafter recycling": "splitinfer drafter recycling --shards shards/smollm2 --out recycling-out",
}
DESCRIPTION = ("Run a language model split across two machines: the text-facing layers here, the middle on a "
               "server.\n`splitinfer GROUP --help` lists a group's commands (bench, privacy, drafter).")
# Commands whose progress is their output, so they log at INFO without -v.
LOUD_COMMANDS = ("serve", "wan")


def _with_example(parser: argparse.ArgumentParser, name: str) -> None:
    parser.epilog = "example: " + EXAMPLES[name]
    parser.formatter_class = argparse.RawDescriptionHelpFormatter  # keep the example on one line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splitinfer", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"splitinfer {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    p.add_argument("--config", help="TOML configuration file (see `splitinfer config show`; precedence: "
                   "command line > SPLITINFER_<COMMAND>_<OPTION> > file > defaults)")
    sub = p.add_subparsers(dest="command", required=True, parser_class=CommandParser, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    for group, (help_text, modules) in GROUPS.items():
        g = sub.add_parser(group, help=help_text, description=help_text)
        inner = g.add_subparsers(dest=f"{group}_command", required=True, parser_class=CommandParser, metavar="COMMAND")
        for name in modules:
            importlib.import_module(name).register(inner)
        _with_example(g, group)
        for name, parser in inner.choices.items():
            _with_example(parser, f"{group} {name}")
    for name, parser in sub.choices.items():
        if name not in GROUPS:
            _with_example(parser, name)
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
