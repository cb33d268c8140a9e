"""The package's import direction, checked on the source text of every module (imports inside functions too).

The core (wire/, kv.py, masks.py, model/, decoding/) is what both sides of the split build on, so it
imports nothing from the programs built on it (local/, cloud/, api/, bench/); the two sides of the split
never import each other, so anything they share lives below them. Both rules hold for what a module
reaches through others too: local/ importing a top-level module that imports cloud/ breaks them as
surely as a direct import (what composes the two, such as inprocess.py, sits above both).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import splitinfer

PACKAGE = Path(splitinfer.__file__).parent
CORE = ("wire", "kv", "masks", "model", "decoding")
APPLICATIONS = ("local", "cloud", "api", "bench", "drafter")

# (importer's top-level part, imported top-level part) -> the rule that forbids it
RULES = {
    **{(core, app): "the core (wire/, kv.py, masks.py, model/, decoding/) imports nothing from local/, cloud/, api/, bench/ or drafter/"
       for core in CORE for app in APPLICATIONS},
    ("local", "cloud"): "local/ and cloud/ never import each other; move what they share below both",
    ("cloud", "local"): "local/ and cloud/ never import each other; move what they share below both",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, the statement with relative names resolved, every absolute module name it may import).

    Every import statement counts, at module level or inside a function.
    """
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
            found.append((node.lineno, "import " + ", ".join(names), names))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            names = [alias.name for alias in node.names]
            # `from . import x` may import the submodule x: check it, not only its package.
            found.append((node.lineno, f"from {source} import " + ", ".join(names), [f"{source}.{n}" for n in names]))
    return found


def part_of(module: str) -> str | None:
    """The top-level part of the package a module belongs to (its subpackage or module), or None outside it."""
    parts = module.split(".")
    if parts[0] != PACKAGE.name or len(parts) < 2:
        return None
    return parts[1]


def violations() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = module_name(path)
        for line, statement, targets in imports_of(path):
            rules = {RULES.get((part_of(importer), part_of(target))) for target in targets} - {None}
            found += [f"{importer} line {line}: `{statement}` breaks the rule: {rule}" for rule in sorted(rules)]
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules its import statements load, their parent packages included."""
    modules = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}

    def loaded(target: str) -> set[str]:
        while target and target not in modules:  # `from m import name`: the module m, unless name is one
            target = target.rpartition(".")[0]
        parts = target.split(".") if target else []
        return {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & modules.keys()

    return {name: {m for _, _, targets in imports_of(path) for t in targets for m in loaded(t)} - {name}
            for name, path in modules.items()}


def reach_violations() -> list[str]:
    """Every rule broken through a chain of imports, with a shortest chain that breaks it."""
    graph, found = import_graph(), []
    for start in sorted(graph):
        via, queue = {start: None}, [start]
        for module in queue:
            for target in sorted(graph[module] - via.keys()):
                via[target] = module
                queue.append(target)
        broken = [t for t in via if RULES.get((part_of(start), part_of(t)))]
        # A package reached only as the parent of a module reached too says nothing more: name the module.
        for target in [t for t in broken if not any(o.startswith(t + ".") for o in broken)]:
            chain = [target]
            while via[chain[-1]] is not None:
                chain.append(via[chain[-1]])
            found.append(f"{' -> '.join(reversed(chain))} breaks the rule: {RULES[(part_of(start), part_of(target))]}")
    return found


def test_import_direction():
    found = violations()
    assert not found, "imports against the package's direction:\n" + "\n".join(found)


def test_import_direction_through_other_modules():
    found = reach_violations()
    assert not found, "modules reaching against the package's direction through others:\n" + "\n".join(found)


def test_the_checker_sees_relative_and_function_level_imports(tmp_path, monkeypatch):
    # A checker that parses nothing would pass the test above: show it catches both forms.
    package = tmp_path / PACKAGE.name
    (package / "decoding").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "decoding" / "__init__.py").write_text("")
    (package / "decoding" / "bad.py").write_text("def f():\n    from ..local import session\n")
    (package / "cloud").mkdir()
    (package / "cloud" / "__init__.py").write_text("")
    (package / "cloud" / "bad.py").write_text("import splitinfer.local.auth as auth\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    assert violations() == [
        f"{PACKAGE.name}.cloud.bad line 1: `import {PACKAGE.name}.local.auth` breaks the rule: {RULES[('cloud', 'local')]}",
        f"{PACKAGE.name}.decoding.bad line 2: `from {PACKAGE.name}.local import session` breaks the rule: "
        f"{RULES[('decoding', 'local')]}",
    ]


def test_the_checker_follows_chains_of_imports(tmp_path, monkeypatch):
    # local/ -> a top-level module -> cloud/: no single import breaks a rule, the chain does.
    package = tmp_path / PACKAGE.name
    for sub in ("local", "cloud"):
        (package / sub).mkdir(parents=True)
        (package / sub / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "local" / "client.py").write_text("from ..glue import make\n")
    (package / "glue.py").write_text("def make():\n    from .cloud.sessions import SessionTable\n")
    (package / "cloud" / "sessions.py").write_text("SessionTable = object\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    assert violations() == []
    name = PACKAGE.name
    assert reach_violations() == [
        f"{name}.local.client -> {name}.glue -> {name}.cloud.sessions breaks the rule: {RULES[('local', 'cloud')]}",
    ]
