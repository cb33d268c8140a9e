"""The messages of one connection, read as they arrive, so that a step can be judged against later ones.

The server takes a connection's messages one at a time, in order, and sends each step's reply before it
takes the next. With blocks in flight (protocol v3) a client sends steps without waiting, so while one
step computes, later ones wait here; when a later one already shows that the client dropped an earlier one
(wire/serverlink.py `dropped`), the earlier one need not run. The inbox reads at most `limit` messages ahead, so
a peer that floods its connection still meets the WebSocket's backpressure. Messages that arrived before
the connection closed are still handed out, as the WebSocket itself does.

Looking ahead decodes the waiting messages (decoding is validation); one that fails is left for its turn,
where its error is reported as ever, and the look stops there. It knows no session and runs no model.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from dataclasses import dataclass

from websockets.exceptions import ConnectionClosed

from ..errors import SplitInferError
from ..wire.messages import Limits, Step, decode_client_message


@dataclass
class _Waiting:
    data: bytes
    step: Step | None = None  # decoded by a look ahead, when it is a step
    looked: bool = False


class Inbox:
    """An async context manager over one connection: `next()` the next message, `later_steps()` a look ahead."""

    def __init__(self, ws, limits: Limits, limit: int):
        self._ws = ws
        self._limits = limits
        self._limit = max(limit, 1)
        self._waiting: deque[_Waiting] = deque()
        self._closed = False
        self._changed = asyncio.Condition()
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> "Inbox":
        self._task = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _read(self) -> None:
        try:
            async for data in self._ws:
                async with self._changed:
                    await self._changed.wait_for(lambda: len(self._waiting) < self._limit)
                    self._waiting.append(_Waiting(data))
                    self._changed.notify_all()
        except ConnectionClosed:
            pass
        finally:
            self._closed = True
            async with self._changed:
                self._changed.notify_all()

    async def next(self) -> bytes | None:
        """The next message's bytes; None once the connection closed and nothing is left."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._waiting or self._closed)
            if not self._waiting:
                return None
            data = self._waiting.popleft().data
            self._changed.notify_all()
            return data

    def later_steps(self) -> list[Step]:
        """The steps that arrived after the message `next` gave last, in order, up to the first message that is
        not a step (another session's hello, a close) or does not decode."""
        steps = []
        for waiting in self._waiting:
            if not waiting.looked:
                waiting.looked = True
                try:
                    message = decode_client_message(waiting.data, self._limits)
                except SplitInferError:
                    message = None
                waiting.step = message if isinstance(message, Step) else None
            if waiting.step is None:
                break
            steps.append(waiting.step)
        return steps
