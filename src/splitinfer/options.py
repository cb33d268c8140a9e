"""Command-line options derived from the typed config dataclasses, so each default is written once.

An `Opt` names one field of a frozen config dataclass; `add_options` turns a tuple of them into argparse
options carrying the field's default and type, and `config_from_args` builds the dataclass back from the
parsed arguments. A command keeps its tuple of `Opt`s beside its code and uses it both ways. Each option
made here records its `Mirror`, so a test can check every mirrored default against its field.

Most config dataclasses live in modules that import torch. `CommandParser` lets a command `defer` adding
such options until that command is parsed or its help is shown, so `splitinfer --help` and light commands
(`wan`, `plan`) start without loading torch. This module knows no command and imports nothing heavy.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Sequence

from .errors import ConfigError

MIB = 1024 * 1024
_UNSET = object()


@dataclasses.dataclass(frozen=True)
class Opt:
    """One command-line option standing for one field of a config dataclass."""

    field: str  # the dataclass field
    flag: str | None = None  # default: --field-name
    help: str | None = None
    scale: int | None = None  # field value = option value * scale (e.g. MIB for an option given in MiB)
    type: Callable | None = None  # default: the field's type (int, float or str)
    default: object = _UNSET  # a command's own default where it deliberately differs from the field's
    choices: Sequence | None = None
    metavar: str | None = None

    @property
    def option(self) -> str:
        return self.flag or "--" + self.field.replace("_", "-")

    @property
    def dest(self) -> str:
        return self.option.lstrip("-").replace("-", "_")


@dataclasses.dataclass(frozen=True)
class Mirror:
    """What an option mirrors: recorded on the argparse action as `action.mirror`."""

    cls: type
    field: str
    scale: int | None
    overridden: bool  # the command sets its own default instead of the field's

    def field_default(self):
        value = field_default(self.cls, self.field)
        return value if self.scale is None or value is None else _unscale(value, self.scale)


@dataclasses.dataclass(frozen=True)
class Shared:
    """Defaults that several commands share, each written once; a command adds the ones it takes, as the
    `Opt`s below (SHARDS, DEVICE, ...) whose help is written there once."""

    shards: str = "shards/smollm2"  # a prepared OUT directory (`make prepare` writes this one)
    out: str = "bench-out"  # where a benchmark writes its JSON and Markdown
    device: str = "cpu"  # torch device of the layers this process runs: cpu, cuda, cuda:1 ...
    host: str = "127.0.0.1"  # the interface a listener binds: loopback unless told
    threads: int | None = None  # torch intra-op threads; None: torch's choice
    allow_public_weights: bool = False  # a client command accepts stock public local weights (docs/privacy.md)


# The options several commands take, each one's help written here once: a command adds them with
# `add_options(parser, Shared, (DEVICE, THREADS))`, or with its own config where the value is one of that
# config's fields (serve's --host is ServerConfig.host). tests/test_cli.py holds every help literal to one place.
SHARDS = Opt("shards", help="a prepared OUT directory (OUT/local + OUT/cloud)")
DEVICE = Opt("device", help="torch device of the layers this process runs: cpu, cuda, cuda:1 ...")
HOST = Opt("host", help="the interface to listen on (default: loopback)")
THREADS = Opt("threads", help="torch intra-op threads (default: torch's choice)")
ALLOW_PUBLIC_WEIGHTS = Opt("allow_public_weights", help="run even though the local layers are the stock public "
                                                        "weights (the cloud can invert them)")


def field_default(cls: type, name: str):
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
            raise TypeError(f"{cls.__name__}.{name} has no default to offer an option")
    raise TypeError(f"{cls.__name__} has no field {name!r}")


def _unscale(value, scale: int):
    out = value / scale
    return int(out) if float(out).is_integer() else out


def _scalar_type(cls: type, name: str) -> type:
    """int, float, str or bool from the field's annotation, with `| None` stripped."""
    hint = typing.get_type_hints(cls)[name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = inner[0] if len(inner) == 1 else hint
    if hint not in (int, float, str, bool):
        raise TypeError(f"{cls.__name__}.{name} ({hint}) has no command-line form; give the option by hand")
    return hint


def described(cls: type, *fields: str) -> tuple[Opt, ...]:
    """One `Opt` per field whose help is the comment on the field's line in `cls`'s source, so a command whose
    options say no more than their fields' comments writes neither twice."""
    import ast
    import inspect
    import io
    import textwrap
    import tokenize

    source = textwrap.dedent(inspect.getsource(cls))
    comments = {t.start[0]: t.string.lstrip("# ") for t in tokenize.generate_tokens(io.StringIO(source).readline)
                if t.type == tokenize.COMMENT}
    lines = {node.target.id: node.end_lineno for node in ast.parse(source).body[0].body
             if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
    missing = [f for f in fields if lines.get(f) not in comments]
    if missing:
        raise TypeError(f"{cls.__name__}: no comment on the line of {', '.join(missing)}")
    return tuple(Opt(f, help=comments[lines[f]]) for f in fields)


def add_options(parser: argparse.ArgumentParser, cls: type, opts: Sequence[Opt]) -> None:
    """Add one option per `Opt`, with the field's default (or the Opt's own) and type."""
    for opt in opts:
        kind = _scalar_type(cls, opt.field)
        mirror = Mirror(cls, opt.field, opt.scale, opt.default is not _UNSET)
        default = mirror.field_default() if opt.default is _UNSET else opt.default
        if kind is bool:
            if default is not False:
                raise TypeError(f"{cls.__name__}.{opt.field}: only flags that default to off are supported")
            action = parser.add_argument(opt.option, action="store_true", help=opt.help)
        else:
            action = parser.add_argument(opt.option, type=opt.type or (None if kind is str else kind),
                                         default=default, choices=opt.choices, help=opt.help, metavar=opt.metavar)
        action.mirror = mirror


def config_values(cls: type, args: argparse.Namespace, opts: Sequence[Opt]) -> dict:
    """The fields the options stand for, in the field's units."""
    values = {}
    for opt in opts:
        value = getattr(args, opt.dest)
        if opt.scale is not None and value is not None:
            value = value * opt.scale
            value = int(value) if _scalar_type(cls, opt.field) is int else value
        values[opt.field] = value
    return values


def config_from_args(cls: type, args: argparse.Namespace, opts: Sequence[Opt], **fixed):
    """Build `cls` from the parsed options plus `fixed` fields; its own checks become a ConfigError."""
    try:
        return cls(**config_values(cls, args, opts), **fixed)
    except ValueError as exc:
        # The dataclass names its fields; point at the options that stand for the ones it names.
        named = [opt.option for opt in opts if opt.field in str(exc)] or [opt.option for opt in opts]
        raise ConfigError(f"{exc} Fix {' or '.join(named)}.") from exc


# -- lazily completed subcommand parsers ---------------------------------------------------------------
class CommandParser(argparse.ArgumentParser):
    """A subcommand parser whose deferred options are added the first time it parses or shows help."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.deferred: list[Callable[[argparse.ArgumentParser], None]] = []

    def complete(self) -> argparse.ArgumentParser:
        while self.deferred:
            self.deferred.pop(0)(self)
        return self

    def parse_known_args(self, args=None, namespace=None):
        self.complete()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self.complete()
        return super().format_help()

    def format_usage(self) -> str:
        self.complete()
        return super().format_usage()


def defer(parser: argparse.ArgumentParser, build: Callable[[argparse.ArgumentParser], None]) -> None:
    """Run `build(parser)` when the command is used (a CommandParser), or now (any other parser)."""
    if isinstance(parser, CommandParser):
        parser.deferred.append(build)
    else:
        build(parser)


def complete(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The parser with every deferred option added."""
    return parser.complete() if isinstance(parser, CommandParser) else parser


def check_args(doc: str, given: tuple[str, str], cls: type, opts: Sequence[Opt],
               argv: list[str] | None) -> argparse.Namespace:
    """The parsed arguments of a `python -m` check (bench/devicestep.py, bench/splitcheck.py): its required
    input `given` (flag, help), `cls`'s options `opts`, and --out, the JSON file it writes."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument(given[0], required=True, help=given[1])
    add_options(parser, cls, opts)
    parser.add_argument("--out", required=True, help="the JSON file to write")
    return parser.parse_args(argv)
