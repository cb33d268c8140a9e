"""One TOML file plus environment variables for every option of every command.

Precedence, highest first:

    1. the command line                      splitinfer serve --port 9000
    2. the environment                       SPLITINFER_SERVE_PORT=9000   (SPLITINFER_<COMMAND>_<OPTION>)
    3. the configuration file, [command]     [serve] port = 9000
       then its [defaults] table             [defaults] device = "cuda"   (every command with that option)
    4. the built-in defaults                 (`--help`)

The file is the one named by `--config PATH` (before the command), else $SPLITINFER_CONFIG, else
./splitinfer.toml, else ~/.config/splitinfer/config.toml; none is needed. Keys are option names with
dashes or underscores (`max-new-tokens` or `max_new_tokens`); unknown keys are errors, so typos do not
pass silently. An option that may be repeated (`Repeated`, e.g. `--server`) takes a TOML list in the file
and a comma-separated list in the environment; given on the command line, it replaces them. This works generically over the argparse subcommands, so commands added later are covered
without any change here. `splitinfer config show` prints the effective values and where each came from,
with secrets masked.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError
from .options import complete

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

CONFIG_ENV = "SPLITINFER_CONFIG"
ENV_PREFIX = "SPLITINFER_"
DEFAULT_PATHS = (Path("splitinfer.toml"), Path("~/.config/splitinfer/config.toml"))
DEFAULTS_TABLE = "defaults"
SECRET = re.compile(r"(^|_)(token|secret|password|passphrase|api_?key)$")
SECRET_ENV = ("SPLITINFER_TOKEN", "SPLITINFER_SERVER_TOKENS")  # credentials read from the environment by auth code
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


class Repeated(argparse.Action):
    """An option that may be given several times, collected into a list (`--server A --server B`).

    Unlike argparse's "append", the first use on the command line replaces the default, so a list from
    the configuration file or the environment is overridden by the command line, not extended by it.
    """

    def __call__(self, parser, namespace, values, option_string=None):
        current = getattr(namespace, self.dest, None)
        items = [] if current is None or current is self.default else list(current)
        setattr(namespace, self.dest, items + [values])


@dataclass(frozen=True)
class Setting:
    value: object
    source: str  # "default", "file", "env" (the command line is not known before parsing)
    origin: str = ""  # the file path and table, or the environment variable


def env_name(command: str, dest: str) -> str:
    """SPLITINFER_SERVE_PORT; a grouped command's name has both words: SPLITINFER_BENCH_SPEC_OUT."""
    return f"{ENV_PREFIX}{command}_{dest}".upper().replace("-", "_").replace(" ", "_")


def table_name(command: str) -> str:
    """The TOML table of a command: [serve], and [bench.spec] for `splitinfer bench spec`."""
    return command.replace(" ", ".")


def is_secret(dest: str) -> bool:
    return bool(SECRET.search(dest))


def subcommands(parser: argparse.ArgumentParser, prefix: str = "") -> dict[str, argparse.ArgumentParser]:
    """Every command that runs, by name; a grouped one as "GROUP COMMAND" ("bench spec")."""
    out: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:  # argparse exposes subparsers only through this attribute
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.update(subcommands(sub, f"{prefix}{name} ") or {f"{prefix}{name}": sub})
    return out


def options(sub: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    complete(sub)  # options a command adds only when used (options.defer)
    return {
        a.dest: a for a in sub._actions
        if a.option_strings and a.dest != argparse.SUPPRESS and not isinstance(a, (argparse._HelpAction, argparse._VersionAction))
    }


def find_config_file(argv: list[str], environ) -> Path | None:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv[: _command_index(argv)])
    explicit = known.config or environ.get(CONFIG_ENV)
    if explicit:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise ConfigError(f"the configuration file {path} does not exist; fix --config or ${CONFIG_ENV}.")
        return path
    return next((p.expanduser() for p in DEFAULT_PATHS if p.expanduser().is_file()), None)


def _run_name(argv: list[str], commands: dict) -> str | None:
    """The command this command line runs ("bench spec" for `splitinfer bench spec ...`), if any."""
    index = _command_index(argv)
    words = [a for a in argv[index:index + 2] if not a.startswith("-")]
    for n in (2, 1):
        if " ".join(words[:n]) in commands:
            return " ".join(words[:n])
    return words[0] if words else None


def _command_index(argv: list[str]) -> int:
    """Index of the first positional argument (the command); global options come before it."""
    skip = False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
        elif arg == "--config":
            skip = True
        elif not arg.startswith("-"):
            return i
    return len(argv)


def load_file(path: Path) -> dict:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the configuration file {path}: {exc}.") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"the configuration file {path} is not valid TOML: {exc}.") from exc
    for key, table in data.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: top-level key {key!r} must be a table, e.g. [serve] or [{DEFAULTS_TABLE}].")
    return data


def _convert_one(action: argparse.Action, value, origin: str):
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in TRUE + FALSE:
            return value.strip().lower() in TRUE
        raise ConfigError(f"{origin} must be true or false; got {value!r}.")
    kind = action.type
    if isinstance(value, str) and value.startswith("~/"):
        value = os.path.expanduser(value)  # the shell expands ~ on the command line; do the same here
    try:
        if isinstance(value, str):
            out = kind(value) if callable(kind) else value
        elif isinstance(value, bool):
            raise TypeError
        elif isinstance(value, (int, float)) and kind in (int, float):
            if kind is int and not float(value).is_integer():
                raise TypeError
            out = kind(value)
        elif isinstance(value, (int, float)) and kind is None:
            out = str(value)
        else:
            raise TypeError
    except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
        want = {int: "an integer", float: "a number"}.get(kind, f"a valid {getattr(kind, '__name__', 'string')}")
        raise ConfigError(f"{origin} must be {want}; got {value!r}.") from exc
    if action.choices is not None and out not in action.choices:
        raise ConfigError(f"{origin} must be one of {', '.join(map(str, action.choices))}; got {out!r}.")
    return out


def convert(action: argparse.Action, value, origin: str):
    many = action.nargs in ("+", "*") or (isinstance(action.nargs, int) and action.nargs > 0)
    if many or isinstance(action, Repeated):
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, list):
            raise ConfigError(f"{origin} must be a list.")
        return [_convert_one(action, v, origin) for v in items]
    return _convert_one(action, value, origin)


def _lookup(data: dict, name: str) -> dict:
    table = data
    for word in name.split():
        table = table.get(word, {}) if isinstance(table, dict) else {}
    return table if isinstance(table, dict) else {}


def _table(data: dict, name: str, known: dict, path: Path | None) -> dict:
    table = {k.replace("-", "_"): v for k, v in _lookup(data, name).items()}
    if name != DEFAULTS_TABLE:
        unknown = sorted(set(table) - set(known))
        if unknown:
            raise ConfigError(f"{path}: [{table_name(name)}] has no option {unknown[0]!r}; "
                              f"`splitinfer {name} --help` lists the options.")
    return table


def _stray(data: dict, commands: dict) -> str | None:
    """The first table that names no command: a top-level one, or one inside a group's table."""
    for key, table in data.items():
        if key == DEFAULTS_TABLE or key in commands:
            continue
        members = {name.split()[1] for name in commands if name.startswith(key + " ")}
        if not members:
            return key
        inner = sorted(set(table) - members)  # a group's table holds its commands' tables, nothing else
        if inner:
            return f"{key}.{inner[0]}"
    return None


def _involved(argv: list[str], data: dict, environ, commands: dict) -> set[str]:
    """The commands whose settings must be read: the one run, any the file or the environment names, and
    all of them for `config show` or a [defaults] table. The others keep their deferred options unbuilt,
    so a plain run does not import what every command needs."""
    run = _run_name(argv, commands)
    if run == "config" or data.get(DEFAULTS_TABLE):
        return set(commands)
    named = {name for name in commands
             if _lookup(data, name) or any(v.startswith(env_name(name, "")) for v in environ)}
    return named | {run}


def apply_config(parser: argparse.ArgumentParser, argv: list[str], environ=None) -> dict[str, dict[str, Setting]]:
    """Install file and environment values as the subcommands' defaults; returns what came from where."""
    environ = os.environ if environ is None else environ
    path = find_config_file(argv, environ)
    data = load_file(path) if path is not None else {}
    commands = subcommands(parser)
    stray = _stray(data, commands)
    if stray:
        raise ConfigError(f"{path}: [{stray}] is not a command; tables are [{DEFAULTS_TABLE}] or a command name "
                          "([serve], [bench.spec]).")
    commands = {name: sub for name, sub in commands.items() if name in _involved(argv, data, environ, commands)}
    every_option = {dest for sub in commands.values() for dest in options(sub)}
    unused = sorted(set(_table(data, DEFAULTS_TABLE, {}, path)) - every_option)
    if unused:
        raise ConfigError(f"{path}: [{DEFAULTS_TABLE}] {unused[0]!r} is an option of no command; check its spelling.")
    report: dict[str, dict[str, Setting]] = {}
    for name, sub in commands.items():
        known = options(sub)
        table, shared = _table(data, name, known, path), _table(data, DEFAULTS_TABLE, known, path)
        settings: dict[str, Setting] = {}
        for dest, action in known.items():
            var = env_name(name, dest)
            if var in environ:
                setting = Setting(convert(action, environ[var], var), "env", var)
            elif dest in table:
                where = f"{path} [{table_name(name)}]"
                setting = Setting(convert(action, table[dest], f"{where} {dest}"), "file", where)
            elif dest in shared:
                origin = f"{path} [{DEFAULTS_TABLE}]"
                setting = Setting(convert(action, shared[dest], f"{origin} {dest}"), "file", origin)
            else:
                settings[dest] = Setting(action.default, "default")
                continue
            sub.set_defaults(**{dest: setting.value})
            action.required = False  # a required option given by the file or the environment is given
            settings[dest] = setting
        report[name] = settings
    report["_file"] = {"path": Setting(str(path) if path else None, "file" if path else "default")}
    return report


# -- `splitinfer config show` ----------------------------------------------------------------------
def register(subparsers) -> None:
    s = subparsers.add_parser("config", help="show the effective configuration (file + environment + defaults)")
    s.add_argument("action", choices=("show",))
    s.add_argument("--command", dest="only", help="only this command's options (a grouped one: 'bench spec')")
    s.add_argument("--json", action="store_true", help="one JSON object instead of TOML")
    s.set_defaults(func=cmd_config)


def _shown(dest: str, value):
    return "****" if is_secret(dest) and value not in (None, "", False) else value


def cmd_config(args) -> int:
    report = getattr(args, "config_report", None)
    if report is None:
        raise ConfigError("the configuration report is missing; run this through the `splitinfer` command.")
    commands = {k: v for k, v in report.items() if not k.startswith("_") and k != "config"}
    if args.only:
        args.only = args.only.replace(".", " ")
        if args.only not in commands:
            raise ConfigError(f"no command {args.only!r}; choose one of {', '.join(sorted(commands))}.")
        commands = {args.only: commands[args.only]}
    secret_env = [name for name in SECRET_ENV if os.environ.get(name) is not None]
    if args.json:
        out = {name: {d: {"value": _shown(d, s.value), "source": s.source, "origin": s.origin} for d, s in opts.items()}
               for name, opts in commands.items()}
        print(json.dumps({"file": report["_file"]["path"].value, "commands": out}, indent=2, default=str))
        return 0
    print("# precedence: command line > environment (SPLITINFER_<COMMAND>_<OPTION>) > file > built-in defaults")
    print(f"# file: {report['_file']['path'].value or 'none (./splitinfer.toml, ~/.config/splitinfer/config.toml)'}")
    for name in secret_env:
        print(f"# {name} = **** (set)")
    for name, opts in commands.items():
        print(f"\n[{table_name(name)}]")
        for dest, s in opts.items():
            note = s.source if s.source == "default" else f"{s.source}: {s.origin}"
            value = _shown(dest, s.value)
            if value is None:
                print(f"# {dest} = (unset)  # {note}")
            else:
                print(f"{dest} = {json.dumps(value)}  # {note}")
    return 0
