"""Which source a measurement ran: the git commit of the splitinfer package it imported (or of another tree a
script times beside it), "-dirty" when that tree had changes (None outside a git checkout). Scripts that store a
run record it beside their command."""

from __future__ import annotations

import subprocess
from pathlib import Path

import splitinfer


def source_commit(source: Path | str | None = None) -> str | None:
    """The commit of the tree holding `source` (a directory; default: the imported splitinfer package)."""
    source = Path(source) if source is not None else Path(splitinfer.__file__).parent

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=source).stdout.strip()

    return (git("rev-parse", "--short", "HEAD") + ("-dirty" if git("status", "--porcelain", "--", ".") else "")) or None
