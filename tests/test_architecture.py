"""No import circles among splitinfer's modules (issue 63): a circle means neither module can be read, tested
or moved without the other, and an import order that happens to work today breaks on the next edit.

Every import counts, at module level or inside a function (a deferred import only hides the circle from the
interpreter, not from a reader), and under `if TYPE_CHECKING:` too. `from package import name` points at
package.name where that is a module, else at the package itself. A circle is reported as the modules in it,
in order, back to the first."""

from __future__ import annotations

import ast
from pathlib import Path

import splitinfer

PACKAGE = Path(splitinfer.__file__).parent


def module_names(package: Path, root: str) -> dict[str, Path]:
    """{dotted module name: file} for every .py under `package` (a package is its __init__.py)."""
    names = {}
    for path in sorted(package.rglob("*.py")):
        parts = [root, *path.relative_to(package).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def imports(name: str, path: Path, modules: set[str]) -> set[str]:
    """The modules of `modules` that the module `name` (file `path`) imports, anywhere in its body."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                # `from . import x` in a package's __init__ is relative to that package, elsewhere to the parent
                base = name.split(".")[: len(name.split(".")) - node.level + is_package]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module
            targets = [f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in modules else origin
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c` of a name inside a.b
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(package: Path, root: str) -> dict[str, set[str]]:
    names = module_names(package, root)
    return {name: imports(name, path, set(names)) for name, path in names.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module (Tarjan), as a path that starts
    and ends at the component's first module by name."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(v: str) -> None:  # recursion depth is bounded by the number of modules (a few hundred)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_circle(graph, component) for component in sorted(components, key=min)]


def _circle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest path from the component's first module back to itself, inside the component (breadth-first)."""
    start = min(component)
    previous = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while previous[path[-1]] is not None:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if w not in previous:
                    previous[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"no circle through {start} in {sorted(component)}")


def test_no_import_circles_among_splitinfer_modules():
    found = cycles(import_graph(PACKAGE, "splitinfer"))
    assert not found, "import circles (move what both modules need into a third):\n" + "\n".join(
        " -> ".join(circle) for circle in found)


def test_the_checker_finds_a_circle_through_a_deferred_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import a\n")
    (pkg / "sub" / "a.py").write_text("from .. import c\nimport os\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .a import x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub.b import y\n")
    (pkg / "d.py").write_text("from .sub import a\nfrom . import c\n")
    graph = import_graph(pkg, "pkg")
    assert graph["pkg.sub"] == {"pkg.sub.a"}
    assert graph["pkg.sub.a"] == {"pkg.c"}
    assert graph["pkg.d"] == {"pkg.sub.a", "pkg.c"}
    assert cycles(graph) == [["pkg.c", "pkg.sub.b", "pkg.sub.a", "pkg.c"]]
    (pkg / "sub" / "b.py").write_text("import os\n")
    assert cycles(import_graph(pkg, "pkg")) == []
