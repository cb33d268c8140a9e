"""The link driver (local/driver.py) on an injected clock: the reconnect backoff and --pad-think-ms pacing are
asked of `sleep`, never waited for here, and a recovery leaves the output unchanged."""

from __future__ import annotations

import pytest
import torch

from splitinfer.errors import Draining, TransportError
from splitinfer.inprocess import InProcessMiddle, load_halves
from splitinfer.local.config import ClientConfig
from splitinfer.local.session import SplitSession

from clock import FakeClock
from tiny import prepare_tiny

PROMPT = [3, 17, 42, 5, 88, 21, 9, 60, 33]
F32 = ClientConfig(wire_dtype="float32", retry_backoff_s=2.0, retry_backoff_max_s=2.0)


@pytest.fixture(scope="module")
def halves(tmp_path_factory):
    return load_halves(prepare_tiny(tmp_path_factory.mktemp("driver"), "llama", 2, 2)[1])


class Flaky(InProcessMiddle):
    """An in-process middle whose first steps fail with the errors given, in order."""

    def __init__(self, cloud, failures):
        super().__init__(cloud)
        self.failures = list(failures)

    def step(self, step):
        if self.failures:
            self.close()  # the cloud session is gone with the link
            raise self.failures.pop(0)
        return super().step(step)


def _prefill(local, middle, config=F32, clock=None):
    session = SplitSession(local, middle, config)
    slept: list[float] = []

    def sleep(seconds):
        slept.append(round(seconds, 6))
        if clock is not None:
            clock.advance(seconds)

    session.driver.sleep = sleep
    if clock is not None:
        session.driver.clock = clock
    logits = session.prefill(PROMPT)
    return session, logits, slept


def test_a_lost_link_backs_off_through_the_injected_sleep_and_recovers_the_same_logits(halves):
    local, cloud = halves
    _, want, slept = _prefill(local, InProcessMiddle(cloud))
    assert slept == []
    session, got, slept = _prefill(local, Flaky(cloud, [TransportError("link dropped")]))
    assert torch.equal(got, want)
    assert len(slept) == 1 and 1.0 <= slept[0] <= 2.0  # the first backoff, jittered in [1/2, 1] of 2 s
    assert sum(r.recoveries for r in session.records) == 1


def test_a_draining_server_is_left_at_once(halves):
    local, cloud = halves
    _, want, _ = _prefill(local, InProcessMiddle(cloud))
    session, got, slept = _prefill(local, Flaky(cloud, [Draining("shutting down")]))
    assert torch.equal(got, want) and slept == [0.0]


def test_pad_think_ms_paces_each_send_from_the_last_reply(halves):
    local, cloud = halves
    clock = FakeClock(100.0)
    config = ClientConfig(wire_dtype="float32", prefill_chunk=4, pad_think_ms=50)
    session, _, slept = _prefill(local, InProcessMiddle(cloud), config, clock)
    chunks = -(-len(PROMPT) // 4)
    assert slept == [0.05] * chunks  # the whole 50 ms before each chunk: no time passes here but the waits
