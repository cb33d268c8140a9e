"""The fast-cloud benchmark's minimum pass time lives in a wrapper, not in the server's pass."""

from __future__ import annotations

import inspect
import time

import pytest
import torch

from splitinfer.cloud import sessions
from splitinfer.cloud.passtime import MinPassTime


class Passes:
    def __init__(self):
        self.calls = []

    def new_cache(self, head_layers):
        return ("cache", head_layers)

    def run(self, head_layers, blocks):
        self.calls.append((head_layers, len(blocks)))
        return [torch.zeros(1, 2) for _ in blocks]


def test_a_pass_lasts_at_least_the_minimum_and_an_empty_one_does_not_wait():
    inner = Passes()
    padded = MinPassTime(inner, 30.0)
    start = time.perf_counter()
    outs = padded.run(2, ["a", "b"])
    assert time.perf_counter() - start >= 0.03 and len(outs) == 2 and inner.calls == [(2, 2)]
    start = time.perf_counter()
    assert padded.run(2, []) == [] and time.perf_counter() - start < 0.03
    assert padded.new_cache(3) == ("cache", 3)
    with pytest.raises(ValueError):
        MinPassTime(inner, -1.0)


def test_the_session_table_never_sleeps():
    assert "sleep" not in inspect.getsource(sessions)
