"""Benchmarks only: passes that last at least a given time, installed around a session table's passes.

A cloud holding a layer or two stands for a GPU, whose pass over the middle takes a few ms whatever its
rows (`bench spec --cloud-pass-ms`, the fast-cloud scenario, which starts `serve --min-pass-ms`). The
server's own pass (sessions.py) knows nothing of this: `serve` wraps its passes here only when asked.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from ..kv import KVCache
from .batch import Block, LocalPasses


class MinPassTime:
    """`passes` (LocalPasses or a stand-in with the same two methods), each `run` padded to `min_ms`: the
    compute thread waits out the rest after the pass (and, on a GPU, after it has finished)."""

    def __init__(self, passes: LocalPasses, min_ms: float, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep):
        if min_ms < 0:
            raise ValueError("the minimum pass time must not be negative.")
        self.passes, self.min_s = passes, min_ms / 1e3
        self.clock, self.sleep = clock, sleep  # seconds; tests pass a fake pair

    def new_cache(self, head_layers: int) -> KVCache:
        return self.passes.new_cache(head_layers)

    def run(self, head_layers: int, blocks: Sequence[Block]) -> list[torch.Tensor]:
        start = self.clock()
        outs = self.passes.run(head_layers, blocks)
        if outs and outs[0].device.type == "cuda":
            torch.cuda.synchronize(outs[0].device)
        left = self.min_s - (self.clock() - start)
        if outs and left > 0:
            self.sleep(left)
        return outs
