"""Every relative link in the README, docs/ and notes/ points at a file that exists (and, for a Markdown
file with #anchor, at one of its headings).

    python scripts/check_links.py            # prints each broken link; exit status 1 if any

Links to http(s) and mailto are not followed (nothing here reaches the network).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def markdown_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md")), *sorted((root / "notes").rglob("*.md"))]


def anchors(path: Path) -> set[str]:
    """GitHub's anchors: headings lower-cased, punctuation but - and _ dropped, spaces as dashes."""
    out = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def links(path: Path):
    fenced = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line.strip()):
            fenced = not fenced
        if not fenced:
            for target in LINK.findall(line):
                yield number, target


def broken(path: Path) -> list[str]:
    out = []
    for number, target in links(path):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            out.append(f"{path.relative_to(ROOT)}:{number}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            out.append(f"{path.relative_to(ROOT)}:{number}: {target} (no such heading)")
    return out


def main() -> int:
    problems = [p for path in markdown_files() for p in broken(path)]
    print("\n".join(problems) if problems else "every link resolves")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
