"""Every default once: no `add_argument` in the package writes a literal default; options take theirs from the
typed config dataclasses through options.py (`Opt`, `add_options`)."""

from __future__ import annotations

import ast
from pathlib import Path

import splitinfer

PACKAGE = Path(splitinfer.__file__).parent
# options.py turns a dataclass field's default into an option's; it writes none of its own.
PLUMBING = {"options.py"}


def _is_literal(node: ast.AST) -> bool:
    """A value written in place: a number, string or True, a negative number, a non-empty literal collection or
    an f-string. None, False and an empty collection mean "no default" and are not counted."""
    if isinstance(node, ast.Constant):
        return node.value is not None and node.value is not False
    if isinstance(node, ast.UnaryOp) and isinstance(node.operand, ast.Constant):
        return True
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return bool(node.elts)
    if isinstance(node, ast.Dict):
        return bool(node.keys)
    return isinstance(node, ast.JoinedStr)


def literal_defaults(source: str, module: str) -> list[str]:
    """'module:line --option' for each add_argument call in `source` whose default= is a literal."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"):
            continue
        for keyword in node.keywords:
            if keyword.arg == "default" and _is_literal(keyword.value):
                flag = ast.unparse(node.args[0]) if node.args else "?"
                found.append(f"{module}:{node.lineno} {flag}")
    return found


def test_no_add_argument_writes_a_literal_default():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).as_posix() not in PLUMBING:
            found += literal_defaults(path.read_text(), path.relative_to(PACKAGE).as_posix())
    assert not found, "literal defaults (put them in a config dataclass and add the option with options.Opt): " + \
        ", ".join(found)


def test_the_checker_finds_literal_defaults_and_passes_the_rest():
    source = (
        "p.add_argument('--a', default=3)\n"
        "p.add_argument('--b', type=float, default=-1.5)\n"
        "p.add_argument('--c', default='tree', help='x')\n"
        "p.add_argument('--d', nargs='*', default=['x'])\n"
        "p.add_argument('--e', default=f'{X}')\n"
        "p.add_argument('--f', default=None)\n"
        "p.add_argument('--g', action='store_true', default=False)\n"
        "p.add_argument('--h', nargs='*', default=[])\n"
        "p.add_argument('--i', default=CONFIG.rows)\n"
        "p.add_argument('--j')\n"
    )
    assert [f.split()[1] for f in literal_defaults(source, "m")] == ["'--a'", "'--b'", "'--c'", "'--d'", "'--e'"]


# -- the Python API ------------------------------------------------------------------------------------------
# The typed configs that own the Python API's defaults: the client's (local/config.py) and the API server's and
# chat's (api/config.py). A library function or class whose parameter is named for one of their fields (or
# stands for one, ALIASES) takes its default from there; a literal in its signature would be a second
# definition. The link's constants (wire/clientlink.py MAX_RETRIES, ROWS_PER_MESSAGE; wire/link.py's pings) are
# the definitions the client config reads, so their parameters are checked too.
ALIASES = {"replay_rows": "prefill_chunk", "default_max_tokens": "max_new_tokens"}
LINK_SETTINGS = {"ping_interval", "ping_timeout"}


def owned_parameters() -> set[str]:
    """Parameter names whose default a typed config owns."""
    import dataclasses

    from splitinfer.api.config import ApiOptions
    from splitinfer.local.config import ClientConfig, ClientOptions

    names = {f.name for config in (ClientConfig, ClientOptions, ApiOptions) for f in dataclasses.fields(config)}
    return names | set(ALIASES) | LINK_SETTINGS


def _is_owned_literal(node: ast.AST) -> bool:
    """A literal default, where 0 reads as "off" (no padding, no hold) like None and False: it restates no
    value of a config's."""
    return _is_literal(node) and not (isinstance(node, ast.Constant) and node.value == 0)


def literal_api_defaults(source: str, module: str, owned: set[str] | None = None) -> list[str]:
    """'module:line name' for each parameter named in `owned` (default: owned_parameters()) with a literal
    default, and each call passing one of the ping settings as a literal."""
    owned = owned_parameters() if owned is None else owned
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args.posonlyargs + node.args.args
            pairs = list(zip(args[len(args) - len(node.args.defaults):], node.args.defaults))
            pairs += [(a, d) for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults) if d is not None]
            found += [f"{module}:{node.lineno} {a.arg}" for a, d in pairs if a.arg in owned and _is_owned_literal(d)]
        if isinstance(node, ast.Call):
            found += [f"{module}:{node.lineno} {k.arg}" for k in node.keywords
                      if k.arg in LINK_SETTINGS and _is_literal(k.value)]
    return found


def test_the_python_api_takes_its_defaults_from_the_typed_configs():
    owned = owned_parameters()
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += literal_api_defaults(path.read_text(), path.relative_to(PACKAGE).as_posix(), owned)
    assert not found, "Python-API defaults written in place (take them from local/config.py, api/config.py or " \
                      "the link's constants): " + ", ".join(found)


def test_the_python_api_defaults_are_the_configs():
    import inspect

    from splitinfer.api.chat import ChatSession
    from splitinfer.api.config import API_DEFAULTS
    from splitinfer.api.engine import Engine
    from splitinfer.api.server import ApiServer
    from splitinfer.local.client import SplitClient
    from splitinfer.local.config import CLIENT_DEFAULTS, ClientConfig
    from splitinfer.local.conversation import Conversation
    from splitinfer.wire.clientlink import ClientLink

    def default(func, name):
        return inspect.signature(func).parameters[name].default

    for func in (SplitClient.generate, SplitClient.conversation, Conversation.__init__, ChatSession.__init__,
                 Engine.__init__):
        assert default(func, "strategy") == CLIENT_DEFAULTS.strategy, func
    assert default(Engine.__init__, "max_concurrent") == API_DEFAULTS.max_concurrent
    assert default(Engine.__init__, "default_max_tokens") == API_DEFAULTS.max_new_tokens
    assert default(ApiServer.__init__, "port") == API_DEFAULTS.port
    assert default(SplitClient.generate, "max_new_tokens") == CLIENT_DEFAULTS.max_new_tokens
    assert default(ClientLink.__init__, "max_retries") == ClientConfig().max_retries
    assert default(ClientLink.__init__, "replay_rows") == ClientConfig().prefill_chunk


def test_the_api_checker_finds_literal_parameters_and_ping_settings():
    source = (
        "def a(x, strategy='tree', *, max_retries=5, y=3): pass\n"
        "def b(strategy=CLIENT_DEFAULTS.strategy, prefill_chunk=None, pad_rows=0): pass\n"
        "connect(url, ping_interval=20, ping_timeout=PING_TIMEOUT_S)\n"
        "class E:\n"
        "    def __init__(self, max_concurrent=4, default_max_tokens=256, port=API_DEFAULTS.port): pass\n"
    )
    assert literal_api_defaults(source, "m") == ["m:1 strategy", "m:1 max_retries", "m:3 ping_interval",
                                                 "m:5 max_concurrent", "m:5 default_max_tokens"]
