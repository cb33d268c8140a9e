"""No module in src/ is longer than 450 lines (issue 50): a module past that size holds more than one job,
and a newcomer cannot find the one they want. Split it into modules named for one thing each."""

from __future__ import annotations

from pathlib import Path

import splitinfer

PACKAGE = Path(splitinfer.__file__).parent
LIMIT = 450


def long_modules(package: Path, limit: int = LIMIT) -> list[str]:
    """'module (lines)' for each .py file under `package` longer than `limit` lines."""
    found = []
    for path in sorted(package.rglob("*.py")):
        lines = len(path.read_text().splitlines())
        if lines > limit:
            found.append(f"{path.relative_to(package).as_posix()} ({lines})")
    return found


def test_no_module_is_longer_than_the_limit():
    found = long_modules(PACKAGE)
    assert not found, f"modules over {LIMIT} lines (split them by job): " + ", ".join(found)


def test_the_checker_counts_lines(tmp_path):
    (tmp_path / "short.py").write_text("x = 1\n" * 3)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "long.py").write_text("x = 1\n" * 5)
    assert long_modules(tmp_path, limit=4) == ["sub/long.py (5)"]
