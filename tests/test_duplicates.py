"""No block of six or more lines is written twice in bench/, decoding/ or local/ (issue 35: one loop, one
driver; issue 50: bench/ on the runtime's plumbing).

Lines are normalised (stripped, comments and blank lines dropped, runs of spaces collapsed), then every
window of WINDOW consecutive remaining lines is hashed; a hash seen at two places is a repeat. Import
blocks, docstrings and function signatures are skipped: a list of imports or of words is not logic
written twice, and a method that implements a Protocol restates its signature by design.
"""

from __future__ import annotations

import ast
import hashlib
import re
from pathlib import Path

import splitinfer

PACKAGE = Path(splitinfer.__file__).parent
CHECKED = ("bench", "decoding", "local")
WINDOW = 6


def significant_lines(source: str) -> list[tuple[int, str]]:
    """(line number, normalised text) of the lines that count: code, not imports, docstrings, signatures,
    Protocol bodies (`...`) or comments."""
    skipped: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            skipped.update(range(node.lineno, node.end_lineno + 1))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            skipped.update(range(node.lineno, node.body[0].lineno))
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and node.value.value is Ellipsis:
            skipped.add(node.lineno)  # a Protocol method's body
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            skipped.update(range(body[0].lineno, body[0].end_lineno + 1))
    out = []
    for number, line in enumerate(source.splitlines(), 1):
        text = re.sub(r"\s+", " ", line.split("  #")[0].strip())
        if number in skipped or not text or text.startswith("#"):
            continue
        out.append((number, text))
    return out


def repeats(files: dict[str, str], window: int = WINDOW) -> list[str]:
    """'a.py:12 and b.py:40' for each window of `window` significant lines that occurs twice (overlapping
    windows of one longer repeat are reported once, at its first line)."""
    seen: dict[str, tuple[str, int]] = {}
    found, last = [], {}
    for name, source in sorted(files.items()):
        lines = significant_lines(source)
        for i in range(len(lines) - window + 1):
            chunk = "\n".join(text for _, text in lines[i : i + window])
            key = hashlib.sha1(chunk.encode()).hexdigest()
            here = (name, lines[i][0])
            if key in seen and seen[key] != here:
                first = seen[key]
                # one report per repeated block: skip windows that continue the previous report's pair
                if last.get(name) != i - 1:
                    found.append(f"{first[0]}:{first[1]} and {name}:{here[1]}")
                last[name] = i
            else:
                seen.setdefault(key, here)
    return found


def test_no_block_of_six_lines_is_repeated_in_bench_decoding_or_local():
    files = {p.relative_to(PACKAGE).as_posix(): p.read_text() for d in CHECKED for p in sorted((PACKAGE / d).rglob("*.py"))}
    found = repeats(files)
    assert not found, f"blocks of {WINDOW}+ lines written twice (make one helper): " + "; ".join(found)


def test_the_checker_finds_a_repeat_across_files_and_within_one_and_ignores_comments():
    block = "\n".join(f"    x{i} = f(x{i - 1})" for i in range(1, 7))
    a = f"def f():\n{block}\n    return x6\n"
    b = f"import os\n\n\ndef g():\n    # a comment\n{block.replace(' = ', '  =  ')}\n    return 0\n"
    assert repeats({"a.py": a, "b.py": b}) == ["a.py:2 and b.py:6"]
    assert repeats({"a.py": a + "\n\n" + a.replace("def f", "def h")}) == ["a.py:2 and a.py:12"]
    assert repeats({"a.py": a, "b.py": "def g():\n" + "\n".join(block.splitlines()[:5])}) == []
    signature = "def run(\n    self,\n    tokens,\n    structure,\n    kind,\n    depths,\n) -> None:\n"
    assert repeats({"a.py": signature + "    ...\n", "b.py": signature + "    return 1\n"}) == []
