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
