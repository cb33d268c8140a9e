"""No module imports another package's private name (`from ..pkg.mod import _name`): what one package
needs from another is public, or it lives where both can reach it."""

from __future__ import annotations

import ast
from pathlib import Path

import splitinfer

PACKAGE = Path(splitinfer.__file__).parent


def private_imports(source: str, name: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level >= 2:  # from .. : another package
            found += [f"{name}:{node.lineno} {alias.name}" for alias in node.names
                      if alias.name.startswith("_") and not alias.name.startswith("__")]
    return found


def test_no_private_name_is_imported_across_packages():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += private_imports(path.read_text(), path.relative_to(PACKAGE).as_posix())
    assert not found, "private names imported from another package (make them public): " + ", ".join(found)


def test_the_checker_sees_a_private_name_from_another_package_only():
    source = "from ..bench.runtime import _pin_self\nfrom .runtime import _mean\nfrom .. import __version__\n"
    assert private_imports(source, "m.py") == ["m.py:1 _pin_self"]
