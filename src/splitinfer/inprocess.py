"""The middle layers in this process, with no wire: the whole model runs locally (`--local-only`, tests).

`InProcessMiddle` implements wire/transport.py's `Middle` over a cloud SessionTable, the same one the
server uses (same validation, same cache), and hands tensors over directly, so no wire rounding happens.
It composes a cloud piece with the local client, so it lives above both local/ and cloud/, which never
import each other.
"""

from __future__ import annotations

import time

from .cloud.sessions import CloudSession, SessionConfig, SessionTable
from .model.shards import CloudHalf
from .wire.messages import Hello, Result, Step, Welcome
from .wire.transport import StepIO


class InProcessMiddle:
    def __init__(self, half: CloudHalf, head_layers: int | None = None):
        self.table = SessionTable(half, SessionConfig(max_sessions=1 << 20, max_cached_tokens=1 << 40, max_block_rows=1 << 16))
        self.cloud_layers = (half.stack.start, half.stack.end)
        self.head_layers = head_layers  # k pinned in every hello; None: the shard's fixed split
        self._session: CloudSession | None = None

    def open(self, resume_id: str | None = None) -> Welcome:
        hello = Hello(
            self.table.half.fingerprint, self.cloud_layers, "float32", session_id=resume_id, head_layers=self.head_layers
        )
        self._session, welcome = self.table.open(hello)
        return welcome

    def step(self, step: Step) -> tuple[Result, StepIO]:
        t0 = time.perf_counter()
        # The session was opened as float32; the tensor's own dtype is what the layers get.
        step = Step(step.seq, step.keep, step.positions, step.structure, step.hidden, wire_dtype="float32")
        result = self.table.run_step(self._session, step, t0)
        return result, StepIO((time.perf_counter() - t0) * 1e3, 0.0, 0, 0)

    def close(self, end_session: bool = True) -> None:
        if self._session is not None:
            self.table.close(self._session.id)
            self._session = None

    def __enter__(self) -> "InProcessMiddle":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
