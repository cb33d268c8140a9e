"""No test waits on the wall clock to make an ordering happen (issue 50): on a loaded 2-core machine those are
the tests that flake. Code with a TTL, window or deadline takes a clock (tests/clock.py drives it); an
ordering between threads is made with an event, a lock or a barrier.

Two things are flagged in every test module:
- a `time.sleep(...)` call that is not polling (the body of a `while` loop that waits for a condition, as
  conftest's `settle` does, is polling: it waits for an event, however often it looks);
- an assert that reads the wall clock (`time.perf_counter()`, `time.monotonic()`, `time.time()`), directly
  or through a name assigned from it in the same function (`elapsed = time.perf_counter() - t0`).
A test that measures time on purpose (a WAN delay, a server's hold) is marked `timing` and `slow`, and says
why in a comment or its docstring; it is exempt.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parent
CLOCKS = {"perf_counter", "monotonic", "time"}


def _is_time_call(node: ast.AST, attrs: set[str]) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in attrs
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "time")


def _reads_clock(node: ast.AST) -> bool:
    return any(_is_time_call(n, CLOCKS) for n in ast.walk(node))


def _marks(func: ast.AST) -> set[str]:
    names = set()
    for decorator in getattr(func, "decorator_list", []):
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Attribute) \
                and target.value.attr == "mark":
            names.add(target.attr)
    return names


def _clock_names(func: ast.AST) -> set[str]:
    """Names in `func` assigned (or appended) a value that reads the wall clock, minus plain time stamps
    (`t0 = time.perf_counter()`: a stamp alone orders nothing; a difference of two does)."""
    names = set()
    for node in ast.walk(func):
        if isinstance(node, ast.Assign) and _reads_clock(node.value) and not _is_time_call(node.value, CLOCKS):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "append" \
                and isinstance(node.func.value, ast.Name) and any(_reads_clock(a) for a in node.args):
            names.add(node.func.value.id)
    return names


def waiting(source: str, module: str) -> list[str]:
    """'module:line what' for each sleep that is not polling and each assert on the wall clock."""
    tree = ast.parse(source)
    polling = {id(n) for loop in ast.walk(tree) if isinstance(loop, ast.While) for stmt in loop.body
               for n in ast.walk(stmt) if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef))}
    found = []
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    exempt = {id(n) for f in functions if {"timing", "slow"} <= _marks(f) for n in ast.walk(f)}
    for node in ast.walk(tree):
        if _is_time_call(node, {"sleep"}) and id(node) not in polling and id(node) not in exempt:
            found.append(f"{module}:{node.lineno} time.sleep")
    for func in functions:
        if id(func) in exempt:
            continue
        names = _clock_names(func)
        for node in ast.walk(func):
            if isinstance(node, ast.Assert) and (
                _reads_clock(node.test) or any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(node.test))
            ):
                found.append(f"{module}:{node.lineno} assert on the wall clock")
    return sorted(set(found))


def test_no_test_waits_on_the_wall_clock():
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        found += waiting(path.read_text(), path.relative_to(TESTS).as_posix())
    assert not found, "tests that order events by the wall clock (use an event, a lock or tests/clock.py; a " \
                      "test that measures time is marked timing and slow): " + ", ".join(found)


def test_the_checker_finds_sleeps_and_clock_asserts_and_spares_polling_and_timing_tests():
    source = (
        "import time\n"
        "def test_a():\n"
        "    time.sleep(0.1)\n"  # 3: ordering by sleeping
        "    start = time.perf_counter()\n"
        "    elapsed = time.perf_counter() - start\n"
        "    assert elapsed < 1\n"  # 6
        "    assert time.monotonic() - start < 5\n"  # 7
        "def settle(cond):\n"
        "    while not cond():\n"
        "        time.sleep(0.02)\n"  # polling: spared
        "@pytest.mark.slow\n"
        "@pytest.mark.timing\n"
        "def test_delay():\n"
        "    t0 = time.perf_counter()\n"
        "    time.sleep(0.01)\n"
        "    assert time.perf_counter() - t0 >= 0.01\n"  # a marked timing test: spared
        "@pytest.mark.timing\n"
        "def test_not_slow():\n"
        "    time.sleep(0.01)\n"  # 19: timing but not in the slow set
    )
    assert waiting(source, "m") == ["m:19 time.sleep", "m:3 time.sleep", "m:6 assert on the wall clock",
                                    "m:7 assert on the wall clock"]
