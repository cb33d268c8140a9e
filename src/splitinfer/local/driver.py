"""The link driver: carries the link's messages over the middle, with reconnects and the one backoff.

Which message goes when (hello, resume, seq, keep, re-sending the history into a fresh session after a
loss) is the link's decision (wire/clientlink.py); this module only does what it asks over the middle
(wire/transport.py), hands it the replies, and sleeps between reconnects (`recover`). It also paces sends
for `--pad-think-ms` (`pace`), since it alone knows when the last reply came.

It never touches the local caches: a recovery does not change the output. Time is injected (`clock`,
`sleep`) so tests can drive the pacing and the backoff without waiting.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from ..errors import Draining, SessionError, TransportError, VersionMismatch
from ..telemetry import StepRecord
from ..wire.clientlink import Answered, Block, ClientLink, Open
from ..wire.link import Client
from ..wire.messages import PIPELINE_VERSION, Close, Result, Welcome
from ..wire.transport import Middle, StepIO
from .config import ClientConfig

log = logging.getLogger("splitinfer.local")
LOST = (SessionError, TransportError)  # what a lost cloud session raises; anything else propagates


class LinkDriver:
    """Drives one session's ClientLink over its Middle.

    on_gone: called when a loss takes every block in flight with it (the session forgets them).
    pipelining: blocks in flight were asked for; False once the server turned the v3 hello down.
    """

    def __init__(self, link: ClientLink, middle: Middle, config: ClientConfig, pipelining: bool,
                 on_gone: Callable[[], None], clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep):
        self.link = link
        self.middle = middle
        self.config = config
        self.pipelining = pipelining
        if pipelining:
            link.version = PIPELINE_VERSION
        self.on_gone = on_gone
        self.clock = clock
        self.sleep = sleep
        self.replied_at = 0.0  # clock time of the last reply: --pad-think-ms paces the next send from it

    # -- one block at a time -------------------------------------------------------------------------
    def through(self, block: Block, record: StepRecord) -> torch.Tensor:
        """The cloud's [q, d] answer to `block`, reconnecting (with backoff) as often as the link allows."""
        self.link.submit(block)
        while True:
            try:
                answer = self._send_next(record)
                if answer is not None:
                    return answer.result.hidden
            except LOST as exc:
                self.recover(exc, record)

    def _send_next(self, record: StepRecord) -> Answered | None:
        """Send what the link asks for and hand it the reply; the block's answer, or None before it."""
        message = self.link.next_send()
        if self._control(message):
            return None
        self.pace()
        result, io = self.middle.step(message)
        self.replied_at = self.clock()
        reply = self.link.on_result(result)
        record.bytes_up += io.bytes_up
        record.bytes_down += io.bytes_down
        if not isinstance(reply, Answered):  # history re-sent: the tail has its replies already
            if reply.done:
                log.info("re-prefilled %d rows into a new cloud session", self.link.committed)
            return None
        record.round_trip_ms += io.round_trip_ms
        record.serialize_ms += io.serialize_ms
        record.cloud_compute_ms += result.compute_ms
        record.server_ms += result.handle_ms
        return reply

    def _control(self, message) -> bool:
        """Open or close the cloud session when the link asks; True when `message` was one of those."""
        if isinstance(message, Open):
            self.link.on_welcome(self.open(message.resume_id))
            return True
        if isinstance(message, Close):
            self.middle.close(end_session=True)
            return True
        return False

    # -- blocks in flight ----------------------------------------------------------------------------
    def post(self, record: StepRecord) -> bool:
        """Send the block submitted ahead without waiting (first whatever the link needs before it: a hello, a
        history re-sent into a fresh session). False when a loss took every block in flight, that one too."""
        while True:
            try:
                message = self.link.next_send()
                if self._control(message):
                    continue
                if self.link.state is Client.FLYING:
                    self.middle.post(message)
                    return True
                self.link.on_result(self.middle.step(message)[0])  # history re-sent into a fresh session
            except LOST as exc:
                if not self.lost(exc, record):
                    return False

    def collect(self, record: StepRecord) -> tuple[Result, StepIO] | None:
        """The reply to the oldest block in flight that is still wanted; None when the link was lost."""
        while True:
            try:
                result, io = self.middle.collect()
                answer = self.link.on_result(result)
            except LOST as exc:
                self.lost(exc, record)
                return None
            if answer is not None:  # else the reply to a block dropped meanwhile
                return result, io

    def settle(self) -> None:
        """Take the replies still due; a loss here is left for the next step to recover."""
        while self.link.flying:
            try:
                self.link.on_result(self.middle.collect()[0])
            except LOST:
                self.link.lost()  # the next step reconnects and rebuilds the cloud session
                return

    def lost(self, exc: Exception, record: StepRecord) -> bool:
        """After a loss: True when the block being sent is still submitted (the loss came before it could go),
        False when every block in flight, that one included, is gone (`on_gone` was called)."""
        self.recover(exc, record)
        if self.link.live or self.link.submitted:
            return True
        self.on_gone()
        return False

    # -- sessions, reconnects and pacing -------------------------------------------------------------
    def recover(self, exc: Exception, record: StepRecord) -> None:
        """The one reconnect rule: tell the link the session was lost, then back off before it reconnects;
        re-raise `exc` once the link has used up its attempts. A draining server is no fault: no attempt, no wait."""
        drained = isinstance(exc, Draining)
        attempt = self.link.lost(counted=not drained)
        if attempt is None:
            raise exc
        delay = 0.0 if drained else self.config.backoff_s(attempt)
        log.warning("cloud session lost (%s); reconnecting in %.2f s", exc, delay)
        self.sleep(delay)
        record.recoveries += 1

    def open(self, resume_id: str | None) -> Welcome:
        welcome = self._hello(resume_id)
        self.replied_at = self.clock()  # the welcome is a reply too: the prompt's send is paced from it
        return welcome

    def _hello(self, resume_id: str | None) -> Welcome:
        if self.link.version is None:
            return self.middle.open(resume_id=resume_id)
        try:
            return self.middle.open(resume_id=resume_id, version=self.link.version)
        except VersionMismatch:
            log.info("the server predates blocks in flight (protocol v%d); one block at a time", PIPELINE_VERSION)
            self.link.version, self.pipelining = None, False
            return self.middle.open(resume_id=resume_id)

    def pace(self) -> None:
        """--pad-think-ms: wait until that long after the last reply, so the next send does not show the
        client's compute."""
        wait = self.replied_at + self.config.pad_think_ms / 1e3 - self.clock()
        if self.config.pad_think_ms and wait > 0:
            self.sleep(wait)

    def close(self) -> None:
        """End the cloud session (best effort) and the link; safe to call more than once."""
        self.middle.close(end_session=True)
        self.link.close()
