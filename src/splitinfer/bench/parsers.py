"""What `splitinfer bench` commands' parsers share: the prepared shards a command reads and the directory it
writes (`add_shards_and_out`), comma-separated numbers read (`floats`) and written (`listed`), and a command that
runs a benchmark with its progress lines on stderr (`reporting`). It imports nothing heavy: every command
registers before torch loads.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from ..errors import ConfigError
from ..options import Opt, Shared, add_options


def add_shards_and_out(parser: argparse.ArgumentParser, outputs: str) -> None:
    """--shards (a prepared OUT directory) and --out, the directory for `outputs` (e.g. "dtype.json and dtype.md")."""
    add_options(parser, Shared, (Opt("shards"), Opt("out", help=f"directory for {outputs}")))


def floats(text: str, name: str) -> tuple[float, ...]:
    """The numbers of a comma-separated option `name` (e.g. --rtt-ms), at least one, none negative."""
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise ConfigError(f"{name} must be comma-separated numbers, e.g. 0,20,40; got {text!r}.") from exc
    if not values or any(v < 0 for v in values):
        raise ConfigError(f"{name} needs at least one value, none negative; got {text!r}.")
    return values


def listed(values) -> str:
    """Numbers as a comma-separated option's value: (1.0, 4.0) -> '1,4'."""
    return ",".join(f"{v:g}" for v in values)


def log_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def reporting(run: Callable[..., object]) -> Callable[[argparse.Namespace], int]:
    """A command running `run(args, log=...)` with its progress on stderr; exit status 0 once it returns."""

    def command(args: argparse.Namespace) -> int:
        run(args, log=log_stderr)
        return 0

    return command
