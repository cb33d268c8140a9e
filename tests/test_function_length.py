"""No function in src/ is longer than 80 lines, except the report templates named below.

A function's length runs from its `def` line to its last line, docstring and comments included; methods
and nested functions count on their own (a nested function's lines also count toward the one that holds it).
"""

from __future__ import annotations

import ast
from pathlib import Path

import splitinfer

PACKAGE = Path(splitinfer.__file__).parent
LIMIT = 80

# Report templates: one long list of Markdown lines, read top to bottom against the report it renders;
# cutting it into pieces would scatter one document over several functions.
EXCEPTIONS = {
    "splitinfer.bench.report.markdown",
}


def function_lengths(source: str, module: str) -> dict[str, int]:
    """Qualified name (module.Class.function, nested functions under their parent) -> lines it spans."""
    lengths = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}.{child.name}"
                if not isinstance(child, ast.ClassDef):
                    lengths[name] = child.end_lineno - child.lineno + 1
                visit(child, name)
            else:
                visit(child, prefix)

    visit(ast.parse(source), module)
    return lengths


def all_lengths() -> dict[str, int]:
    lengths = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        lengths.update(function_lengths(path.read_text(), ".".join(parts)))
    return lengths


def test_no_function_is_longer_than_the_limit():
    lengths = all_lengths()
    long = {name: n for name, n in lengths.items() if n > LIMIT and name not in EXCEPTIONS}
    assert not long, f"functions over {LIMIT} lines (split them): " + ", ".join(f"{k} ({v})" for k, v in sorted(long.items()))


def test_every_exception_still_needs_to_be_one():
    # A stale entry would let a new function of the same name grow past the limit unnoticed.
    lengths = all_lengths()
    stale = sorted(name for name in EXCEPTIONS if lengths.get(name, 0) <= LIMIT)
    assert not stale, f"no longer over {LIMIT} lines or gone; remove from EXCEPTIONS: {stale}"


def test_the_checker_counts_methods_and_nested_functions():
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT))
    source = (
        "class C:\n"
        "    def short(self):\n        return 1\n"
        "    async def long(self):\n" + "\n".join("    " + line for line in body.splitlines()) + "\n"
        "def outer():\n    def inner():\n" + "\n".join("    " + line for line in body.splitlines()) + "\n    return inner\n"
    )
    lengths = function_lengths(source, "m")
    assert lengths == {"m.C.short": 2, "m.C.long": LIMIT + 1, "m.outer.inner": LIMIT + 1, "m.outer": LIMIT + 3}
