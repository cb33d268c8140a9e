"""The WAN emulator's clock: an event loop whose timers keep their microseconds, and the lead that lands a
delivery on its moment.

epoll_wait takes whole milliseconds and Python rounds a timeout up, so on asyncio's default loop every delivery
came up to a millisecond late; the loop here waits on epoll's own descriptor through select()'s microsecond
timeout. A timer still fires a little after its moment (the kernel's slack, the loop's turn), which `Lead`
learns and `proxy._Pipe` wakes that much earlier for.
"""

from __future__ import annotations

import asyncio
import select
import selectors


class PreciseEpoll(getattr(selectors, "EpollSelector", selectors.DefaultSelector)):
    """epoll, waited on through select()'s microsecond timeout; the one descriptor select() watches is epoll's
    own, ready when any socket is."""

    def select(self, timeout: float | None = None):
        if timeout is not None and timeout > 0:
            select.select([self.fileno()], [], [], timeout)
            timeout = 0
        return super().select(timeout)


def run_loop(main) -> None:
    """asyncio.run(main()) on an event loop whose timers keep their microseconds where epoll is there."""
    if not hasattr(selectors, "EpollSelector"):
        asyncio.run(main())
        return
    with asyncio.Runner(loop_factory=lambda: asyncio.SelectorEventLoop(PreciseEpoll())) as runner:
        runner.run(main())


async def sleep_until(loop: asyncio.AbstractEventLoop, when: float) -> None:
    # An absolute deadline avoids the drift of recomputing relative sleeps.
    if when > loop.time():
        fut = loop.create_future()
        handle = loop.call_at(when, lambda: fut.done() or fut.set_result(None))
        try:
            await fut
        finally:
            handle.cancel()


class Lead:
    """How much earlier than a delivery's moment to wake, learned from how late the wakes came: each wake moves
    it by a share of its error, within [0, MAX_LEAD_S], so wakes centre on the moment; one that comes early
    waits out the rest (`proxy._Pipe._write`), so no chunk is delivered before its moment."""

    MAX_LEAD_S = 0.001  # also bounds how long an early wake spins
    WEIGHT = 0.1

    def __init__(self) -> None:
        self.seconds = 0.0

    def observe(self, late: float) -> None:
        self.seconds = min(max(self.seconds + self.WEIGHT * late, 0.0), self.MAX_LEAD_S)
