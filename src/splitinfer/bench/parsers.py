"""What `splitinfer bench` commands' parsers share: the prepared shards a command reads and the directory it
writes (`add_shards_and_out`), and a command that runs a benchmark with its progress lines on stderr
(`reporting`). It imports nothing heavy: every command registers before torch loads.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from ..options import Opt, Shared, add_options


def add_shards_and_out(parser: argparse.ArgumentParser, outputs: str) -> None:
    """--shards (a prepared OUT directory) and --out, the directory for `outputs` (e.g. "dtype.json and dtype.md")."""
    add_options(parser, Shared, (Opt("shards"), Opt("out", help=f"directory for {outputs}")))


def log_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def reporting(run: Callable[..., object]) -> Callable[[argparse.Namespace], int]:
    """A command running `run(args, log=...)` with its progress on stderr; exit status 0 once it returns."""

    def command(args: argparse.Namespace) -> int:
        run(args, log=log_stderr)
        return 0

    return command
