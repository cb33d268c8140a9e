"""options.py: argparse options derived from a config dataclass, and parsers completed on first use."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from splitinfer.errors import ConfigError
from splitinfer.options import MIB, CommandParser, Opt, add_options, complete, config_from_args, defer, described


@dataclass(frozen=True)
class Toy:
    rows: int = 512  # a plain int
    ratio: float = 0.5
    name: str = "tree"
    seed: int | None = None
    limit_bytes: int = 16 * MIB
    verbose: bool = False

    def __post_init__(self):
        if self.rows < 1:
            raise ValueError("rows must be at least 1.")


OPTS = (
    Opt("rows", help="rows"),
    Opt("ratio"),
    Opt("name", choices=("tree", "sequential")),
    Opt("seed"),
    Opt("limit_bytes", "--limit-mb", scale=MIB),
    Opt("verbose"),
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_options(p, Toy, OPTS)
    return p


def test_options_take_the_fields_defaults_and_types():
    p = _parser()
    args = p.parse_args([])
    got = (args.rows, args.ratio, args.name, args.seed, args.limit_mb, args.verbose)
    assert got == (512, 0.5, "tree", None, 16, False)
    args = p.parse_args(["--rows", "7", "--ratio", "2", "--seed", "3", "--limit-mb", "2", "--verbose"])
    assert (args.rows, args.ratio, args.seed, args.limit_mb, args.verbose) == (7, 2.0, 3, 2, True)
    assert type(args.ratio) is float and type(args.rows) is int
    with pytest.raises(SystemExit):
        p.parse_args(["--name", "fast"])


def test_a_config_comes_back_from_the_parsed_options_in_the_fields_units():
    p = _parser()
    assert config_from_args(Toy, p.parse_args([]), OPTS) == Toy()
    got = config_from_args(Toy, p.parse_args(["--limit-mb", "3", "--rows", "9"]), OPTS)
    assert got == Toy(rows=9, limit_bytes=3 * MIB)


def test_a_dataclass_check_becomes_a_config_error_naming_the_option():
    p = _parser()
    with pytest.raises(ConfigError, match=r"rows must be at least 1\. Fix --rows\."):
        config_from_args(Toy, p.parse_args(["--rows", "0"]), OPTS)


def test_mirrors_are_recorded_with_any_override():
    p = argparse.ArgumentParser()
    add_options(p, Toy, (Opt("rows"), Opt("ratio", default=0.25)))
    mirrors = {a.dest: a.mirror for a in p._actions if hasattr(a, "mirror")}
    assert mirrors["rows"].field_default() == 512 and not mirrors["rows"].overridden
    assert mirrors["ratio"].overridden and p.parse_args([]).ratio == 0.25


def test_fields_without_a_command_line_form_are_refused():
    @dataclass(frozen=True)
    class Odd:
        values: tuple[int, ...] = (1, 2)

    with pytest.raises(TypeError, match="no command-line form"):
        add_options(argparse.ArgumentParser(), Odd, (Opt("values"),))


def test_deferred_options_are_added_when_the_command_is_used():
    built = []

    def build(parser):
        built.append(parser)
        add_options(parser, Toy, (Opt("rows"),))

    root = argparse.ArgumentParser()
    sub = root.add_subparsers(dest="command", parser_class=CommandParser)
    s = sub.add_parser("run")
    defer(s, build)
    assert built == [] and "--rows" not in root.format_help()
    assert root.parse_args(["run", "--rows", "3"]).rows == 3
    assert built == [s]
    complete(s)  # once only
    assert built == [s] and "--rows" in s.format_help()

    plain = argparse.ArgumentParser()  # not a CommandParser: built at once
    defer(plain, build)
    assert built == [s, plain]


def test_an_option_described_by_its_field_s_comment():
    assert described(Toy, "rows") == (Opt("rows", help="a plain int"),)
    with pytest.raises(TypeError, match="ratio"):
        described(Toy, "rows", "ratio")  # no comment on its line: write the help


def test_each_help_text_is_written_once():
    """An option several commands take has its help written once, in options.py (SHARDS, DEVICE, HOST, THREADS,
    ALLOW_PUBLIC_WEIGHTS), so the commands cannot drift apart (issue 63). Checked on the source of the command
    modules; bench/ keeps its own options until its commands share one harness (issue 63, item 3)."""
    import ast
    from pathlib import Path

    import splitinfer

    package = Path(splitinfer.__file__).parent
    written: dict[str, list[str]] = {}
    for path in sorted(package.rglob("*.py")):
        module = path.relative_to(package).as_posix()
        if module.startswith("bench/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                for keyword in node.keywords:
                    if keyword.arg == "help" and isinstance(keyword.value, ast.Constant) \
                            and isinstance(keyword.value.value, str):
                        written.setdefault(keyword.value.value, []).append(f"{module}:{node.lineno}")
    twice = {text: places for text, places in written.items() if len(places) > 1}
    assert not twice, "write a shared option's help once, in options.py: " + "; ".join(
        f"{text!r} at {', '.join(places)}" for text, places in twice.items())
