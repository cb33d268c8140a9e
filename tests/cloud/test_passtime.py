"""The fast-cloud benchmark's minimum pass time lives in a wrapper, not in the server's pass."""

from __future__ import annotations

import inspect

import pytest
import torch

from splitinfer.cloud import sessions
from splitinfer.cloud.passtime import MinPassTime

from clock import FakeClock


class Passes:
    def __init__(self):
        self.calls = []

    def new_cache(self, head_layers):
        return ("cache", head_layers)

    def run(self, head_layers, blocks):
        self.calls.append((head_layers, len(blocks)))
        return [torch.zeros(1, 2) for _ in blocks]


class SlowPasses(Passes):
    """Passes that take `seconds` on `clock`."""

    def __init__(self, clock, seconds):
        super().__init__()
        self.clock, self.seconds = clock, seconds

    def run(self, head_layers, blocks):
        self.clock.advance(self.seconds)
        return super().run(head_layers, blocks)


def test_a_pass_lasts_at_least_the_minimum_and_an_empty_one_does_not_wait():
    inner, clock, slept = Passes(), FakeClock(), []

    def sleep(seconds):
        slept.append(round(seconds, 6))
        clock.advance(seconds)

    padded = MinPassTime(inner, 30.0, clock=clock, sleep=sleep)
    outs = padded.run(2, ["a", "b"])
    assert slept == [0.03] and len(outs) == 2 and inner.calls == [(2, 2)]  # the whole 30 ms waited out
    assert padded.run(2, []) == [] and slept == [0.03]  # an empty pass does not wait
    slow = MinPassTime(SlowPasses(clock, 0.05), 30.0, clock=clock, sleep=sleep)
    assert len(slow.run(2, ["a"])) == 1 and slept == [0.03]  # a pass longer than the minimum does not wait
    assert padded.new_cache(3) == ("cache", 3)
    with pytest.raises(ValueError):
        MinPassTime(inner, -1.0)


def test_the_session_table_never_sleeps():
    assert "sleep" not in inspect.getsource(sessions)
