"""Cloud sessions a benchmark steps by hand: B sessions in one SessionTable, each prefilled to its own
length, then stepped with valid seq numbers and keep lists (every row of the last block kept).

Used by `bench batch` (bench/batching.py, bench/lone.py). Inputs are random hidden states: a step's compute
time does not depend on the values. Nothing heavy is imported until a SteppedSessions is made.
"""

from __future__ import annotations


class SteppedSessions:
    """B cloud sessions in one SessionTable, prefilled to different lengths, stepped with valid seq/keep."""

    def __init__(self, half, count: int, context: int):
        import torch

        from ..cloud.sessions import SessionConfig, SessionTable
        from ..wire.messages import Hello

        self.torch = torch
        self.d = half.config.hidden_size
        self.table = SessionTable(half, SessionConfig(max_sessions=count + 1, max_cached_tokens=1 << 30))
        hello = Hello(half.fingerprint, (half.stack.start, half.stack.end), "float32")
        self.sessions = [self.table.open(hello)[0] for _ in range(count)]
        self.seq = [0] * count
        self.keep: list[tuple[int, ...]] = [()] * count
        for i in range(count):  # context lengths context, context + 8, ...: every cache a different length
            length = context + 8 * (i % 8)
            self.table.run_step(self.sessions[i], self.step(i, length), 0.0)

    def step(self, i: int, q: int):
        """Session i's next step: q new rows after its committed and kept ones, the last block kept whole."""
        from ..masks import BlockStructure
        from ..wire.messages import Step

        session = self.sessions[i]
        start = session.cache.length + len(self.keep[i])
        hidden = self.torch.randn(q, self.d)
        positions = tuple(range(start, start + q))
        step = Step(self.seq[i], self.keep[i], positions, BlockStructure.chain(), hidden, "float32")
        self.seq[i] += 1
        self.keep[i] = tuple(range(q))
        return step

    def batched(self, indices, sizes) -> None:
        outcomes = self.table.run_steps([(self.sessions[i], self.step(i, q), 0.0) for i, q in zip(indices, sizes)])
        assert all(not isinstance(o, Exception) for o in outcomes), outcomes

    def one_at_a_time(self, indices, sizes) -> None:
        for i, q in zip(indices, sizes):
            self.batched([i], [q])
