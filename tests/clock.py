"""A clock that tests move by hand, for code that takes `clock=` (SessionTable): time passes only when told."""

from __future__ import annotations


class FakeClock:
    """Callable like time.monotonic; `advance` moves it."""

    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def expire_all(table) -> bool:
    """Run the TTL sweep once; True when the table is empty. A session inside a pass is skipped by the sweep,
    so callers poll this (with `settle`) until the pass has ended."""
    table.expire()
    return len(table) == 0
