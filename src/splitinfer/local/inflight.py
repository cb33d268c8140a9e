"""Blocks in flight: the pipelined half of the `Verifier` that SplitSession offers the decoding loop.

With `ClientConfig.in_flight` > 1 or `AUTO_IN_FLIGHT`, a v3 server and a middle that can `post` (pinned,
or up to MAX_IN_FLIGHT as decoding/ahead.py judges worth it): `send_block` runs the head on a block that
assumes the unresolved blocks before it kept given rows (the head cache holds them, wire/inflight.py builds
the mask) and sends it without waiting; `receive_block` takes the oldest reply through the tail; `resolve`
commits its kept rows on both local caches and tells the link; `drop_unresolved` forgets the blocks whose
assumption failed. The tail cache only ever sees resolved blocks, in order, so it never holds more than one
pending block. A loss with blocks in flight drops them all and rebuilds the cloud session from the committed
history; the decoding loop sends again from there. One block at a time (`wait`, or a session that cannot
send ahead) goes through the forward pass (`run_block`) and `commit` instead.

`BlocksInFlight` is a mixin of SplitSession (session.py): it uses the session's head, caches, link, driver,
records and `_tail`, and keeps its own state (`_ahead`, `_done`, `_received`) set up by `_init_in_flight`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from ..masks import BlockStructure
from ..telemetry import StepRecord
from ..wire.clientlink import Block
from ..wire.inflight import Prefix, prefix_mask
from .config import AUTO_IN_FLIGHT, MAX_IN_FLIGHT


@dataclass
class _Ahead:
    """A block sent ahead and not resolved yet, as the local side keeps it."""

    positions: tuple[int, ...]
    allowed: np.ndarray  # [q, q] bool
    record: StepRecord
    sent: torch.Tensor  # [q, d] the head layers' output, as it left for the wire (a fused draft head reads it)


def positions_of(base: int, structure: BlockStructure, q: int, depths: list[int] | None) -> list[int]:
    """Each row's position: `base` plus its depth (given, else the structure's, else 0..q-1)."""
    depths = structure.depths(q) if depths is None else depths
    return [base + d for d in depths] if depths is not None else list(range(base, base + q))


class BlocksInFlight:
    """Send, receive, resolve and drop blocks that overlap on the wire (see the module docstring)."""

    def _init_in_flight(self) -> None:
        wanted = MAX_IN_FLIGHT if self.config.in_flight == AUTO_IN_FLIGHT else self.config.in_flight
        self._depth = wanted
        self._ahead: list[_Ahead] = []  # blocks sent ahead and not resolved, oldest first
        self._received: tuple[float, float] = (0.0, 0.0)  # (cloud compute, tail) ms of the last block received
        self._done: torch.Tensor | None = None  # logits of a block sent with `wait`, until `receive_block`

    @property
    def in_flight(self) -> int:
        """Blocks this session may have in flight at once: the configured number where the transport and the
        server allow it (known once the session is open), else 1."""
        if not self.driver.pipelining or self.link.welcome is None:
            return 1
        return min(self._depth, self.link.max_in_flight)

    @property
    def pinned(self) -> bool:
        """True when --in-flight pins the blocks in flight; False when the controller chooses (auto)."""
        return self.config.in_flight != AUTO_IN_FLIGHT

    def block_costs(self) -> tuple[float, float]:
        """(cloud compute ms, local tail ms) of the block `receive_block` returned last."""
        return self._received

    def send_block(
        self, tokens: list[int], structure: BlockStructure, depths: list[int] | None, assume: list[list[int]],
        wait: bool = False,
    ) -> bool:
        """Run the head on a block and send it without waiting for the unresolved blocks before it; `assume`
        holds the rows it assumes kept of each of them, oldest first. False when the link was lost: every
        block in flight is gone (nothing was sent), and the next block must assume none. `wait` (one block at
        a time, or a session that cannot send ahead): the block goes through the whole model now
        (`run_block`), for `receive_block` to hand back."""
        if (wait or self.in_flight == 1) and not self._ahead:
            self._done = self.run_block(tokens, structure, depths=depths)
            return True
        q = len(tokens)
        positions = positions_of(self.length + sum(len(rows) for rows in assume), structure, q, depths)
        record = StepRecord(kind="decode", rows=q, accepted=0, assumed=len(assume))
        t0 = time.perf_counter()
        pos = torch.tensor(positions, dtype=torch.long, device=self._device)
        allowed = structure.allowed(q)
        prefix = Prefix.of([(a.positions, tuple(rows)) for a, rows in zip(self._ahead, assume)], self._device)
        with torch.inference_mode():
            embedded = self.local.embed(torch.tensor([tokens], dtype=torch.long, device=self._device))
            masks = {
                w: prefix_mask(self.head_cache.length, prefix, pos, allowed, embedded.dtype, w)
                for w in set(self.head.windows)
            }
            hidden = self.head.run_layers(embedded, pos[None], masks, self.head_cache)  # [1, q, d]
        self.head_cache.hold()
        record.local_ms = (time.perf_counter() - t0) * 1e3
        self.records.append(record)
        self._ahead.append(_Ahead(tuple(positions), allowed, record, hidden[0]))
        self.link.submit_ahead(Block(tuple(positions), structure, hidden[0]), assume)
        return self.driver.post(record)

    def receive_block(self) -> torch.Tensor | None:
        """The oldest unresolved block's logits [q, vocab] float32 (through the tail); None when the link was
        lost and every block in flight with it."""
        if self._done is not None:  # a block that went through the whole model when sent
            logits, self._done = self._done, None
            return logits
        ahead = self._ahead[0]
        got = self.driver.collect(ahead.record)
        if got is None:
            return None
        result, io = got
        record = ahead.record
        record.bytes_up, record.bytes_down = io.bytes_up, io.bytes_down
        record.round_trip_ms, record.serialize_ms = io.round_trip_ms, io.serialize_ms
        record.cloud_compute_ms, record.server_ms = result.compute_ms, result.handle_ms
        pos = torch.tensor(ahead.positions, dtype=torch.long, device=self._device)
        logits, tail_ms = self._tail(result.hidden, pos, ahead.allowed, self.local.embed.weight.dtype, sent=ahead.sent)
        record.local_ms += tail_ms
        self._received = (result.compute_ms, tail_ms)
        return logits

    def resolve(self, rows: list[int], assumption: tuple[float, bool] | None = None) -> None:
        """Accept `rows` of the oldest unresolved block (received): kept on both local caches now, on the
        cloud with the next step. assumption: (the chance given, whether it held) of what a block after it
        assumed or would have assumed, recorded on its step."""
        if not self._ahead:  # it went through the whole model when sent
            self.commit(rows)
            return
        ahead = self._ahead.pop(0)
        self.head_cache.keep(rows)  # the oldest held block
        self.tail_cache.keep(rows)
        self.link.resolve(rows)
        ahead.record.accepted = len(rows)
        if assumption is not None:
            ahead.record.ahead_p, ahead.record.ahead_held = round(assumption[0], 4), assumption[1]

    def drop_unresolved(self, kind: str = "dropped") -> None:
        """Forget every unresolved block; telemetry counts their steps as `kind`: "dropped" when their
        assumption failed, "unused" when decoding ended first."""
        for ahead in self._ahead:
            ahead.record.kind = kind
        self.link.drop_live()
        self._forget_ahead()

    def _forget_ahead(self) -> None:
        self._ahead = []
        self.head_cache.drop_newer(0)

    def settle(self) -> None:
        """Drop what is still in flight and take the replies still due, so that the connection is in step for
        the next block sent one at a time. A loss here is left for the next step to recover."""
        self._done = None
        if not self._ahead and not self.link.flying:
            return
        self.drop_unresolved("unused")
        self.driver.settle()
