"""A connection's inbox: messages handed out in order, read ahead within a bound, looked ahead up to the
first message that is not a step.

Ordering comes from the event loop, not the clock: `run_ready` yields until every ready task has run as
far as it can, so no test waits on real time.
"""

from __future__ import annotations

import asyncio

import torch

from splitinfer.cloud.inbox import Inbox
from splitinfer.masks import BlockStructure
from splitinfer.wire.messages import Assumed, Close, Hello, Limits, Step

D = 4
LIMITS = Limits(hidden_size=D, dtypes=("float32",))


def step(seq: int, assume=()) -> Step:
    return Step(seq, (), (seq,), BlockStructure.chain(), torch.zeros(1, D), "float32", assume)


class Peer:
    """Stands for a WebSocket: yields the given messages, then ends as a closed connection does."""

    def __init__(self, messages: list[bytes]):
        self.messages = messages
        self.read = 0
        self.ended = False  # the reader asked past the last message (all before it were placed)

    def __aiter__(self):
        return self

    async def __anext__(self) -> bytes:
        await asyncio.sleep(0)
        if self.read == len(self.messages):
            self.ended = True
            raise StopAsyncIteration
        self.read += 1
        return self.messages[self.read - 1]


async def run_ready(turns: int = 100) -> None:
    """Give the loop's other tasks `turns` turns: the inbox's reader runs until it waits on the peer or its bound."""
    for _ in range(turns):
        await asyncio.sleep(0)


def test_messages_come_in_order_and_the_look_ahead_stops_at_another_kind():
    hello = Hello("f", (1, 2), "float32")
    sent = [step(1).encode(), step(2, (Assumed(1, (0,)),)).encode(), step(3).encode(), hello.encode(),
            step(4).encode(), b"\x00garbage", Close().encode()]

    async def scenario():
        peer = Peer(sent)
        async with Inbox(peer, LIMITS, limit=16) as inbox:
            first = await inbox.next()
            await run_ready()  # the rest arrives while the first is handled
            assert peer.ended
            later = [s.seq for s in inbox.later_steps()]
            got = [first] + [m async for m in _drain(inbox)]
        return later, got

    later, got = asyncio.run(scenario())
    assert later == [2, 3]  # not the step after the hello: it belongs to another session
    assert got == sent


async def _drain(inbox: Inbox):
    while (message := await inbox.next()) is not None:
        yield message


def test_the_inbox_reads_no_further_ahead_than_its_limit():
    peer = Peer([step(i).encode() for i in range(10)])

    async def scenario():
        async with Inbox(peer, LIMITS, limit=3) as inbox:
            await run_ready()
            held = peer.read
            first = await inbox.next()
            await run_ready()
            return held, peer.read, first

    held, after_one, first = asyncio.run(scenario())
    assert first == step(0).encode()
    assert (held, after_one) == (4, 5)  # `limit` waiting, plus one read and not yet placed
