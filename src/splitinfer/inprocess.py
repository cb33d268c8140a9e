"""The middle layers in this process, with no wire: the whole model runs locally (`--local-only`, tests).

`InProcessMiddle` implements wire/transport.py's `Middle` over a cloud SessionTable, the same one the
server uses (same validation, same cache), and hands tensors over directly, so no wire rounding happens;
given a wire dtype, it passes every step and result through the wire's own encoding instead (the bytes a
server would receive and send: `bench exactness` measures what that rounding changes).
`load_halves` reads both halves of a prepared OUT directory; `prepare_temporary` prepares a model for
`--local-only`. The client factory (clients.py `open_client`) builds the SplitClient on them. It holds a
cloud piece, so it lives above both local/ and cloud/, which never import each other.
"""

from __future__ import annotations

import tempfile
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from .cloud.sessions import CloudSession, SessionConfig, SessionTable
from .errors import ConfigError
from .model.shards import CloudHalf, LocalHalf, load_cloud, load_local
from .wire.messages import Hello, Limits, Result, Step, Welcome, decode_client_message, decode_server_message
from .wire.transport import StepIO


class InProcessMiddle:
    # Blocks in flight buy nothing without a round trip to hide; `post`/`collect` run a step at once.
    sends_ahead = False

    def __init__(self, half: CloudHalf, head_layers: int | None = None, wire_dtype: str | None = None):
        rows = 1 << 16
        self.table = SessionTable(half, SessionConfig(max_sessions=1 << 20, max_cached_tokens=1 << 40, max_block_rows=rows))
        self.cloud_layers = (half.stack.start, half.stack.end)
        self.head_layers = head_layers  # k pinned in every hello; None: the shard's fixed split
        self.wire_dtype = wire_dtype  # None: tensors handed over as they are (float32)
        self.limits = Limits(half.config.hidden_size, max_block_rows=rows)
        self._session: CloudSession | None = None
        self._posted: deque[tuple[Result, StepIO]] = deque()  # results of posted steps, oldest first

    def open(self, resume_id: str | None = None, version: int | None = None) -> Welcome:
        hello = Hello(
            self.table.half.fingerprint, self.cloud_layers, self.wire_dtype or "float32", session_id=resume_id,
            head_layers=self.head_layers, version=version,
        )
        self._session, welcome = self.table.open(hello)
        return welcome

    def step(self, step: Step) -> tuple[Result, StepIO]:
        t0 = time.perf_counter()
        if self.wire_dtype is None:
            # The session was opened as float32; the tensor's own dtype is what the layers get.
            step = Step(step.seq, step.keep, step.positions, step.structure, step.hidden, wire_dtype="float32")
            result = self.table.run_step(self._session, step, t0)
        else:  # through the wire's encoding both ways, as a server receives and sends it
            result = self.table.run_step(self._session, decode_client_message(step.encode(), self.limits), t0)
            result = decode_server_message(result.encode(), self.limits)
        return result, StepIO((time.perf_counter() - t0) * 1e3, 0.0, 0, 0)

    def post(self, step: Step) -> None:
        self._posted.append(self.step(step))

    def collect(self) -> tuple[Result, StepIO]:
        return self._posted.popleft()

    def cover(self, request_bytes: int, reply_bytes: int, hold_ms: float) -> None:
        """No network between the halves, so nothing for an observer to count."""

    def close(self, end_session: bool = True) -> None:
        if self._session is not None:
            self.table.close(self._session.id)
            self._session = None

    def __enter__(self) -> "InProcessMiddle":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_halves(shards: str | Path, device: str = "cpu",
                check: Callable[[LocalHalf], None] | None = None) -> tuple[LocalHalf, CloudHalf]:
    """Both halves of a prepared OUT directory (OUT/local + OUT/cloud), checked to be from one `prepare`;
    `check(local)` runs on the local half before the cloud half loads, so a refusal costs no cloud load."""
    shards = Path(shards)
    local = load_local(shards / "local", device=device)
    if check is not None:
        check(local)
    cloud = load_cloud(shards / "cloud", device=device)
    if cloud.fingerprint != local.fingerprint:
        raise ConfigError(f"{shards}/local and {shards}/cloud were not prepared together; re-run prepare.")
    return local, cloud


def prepare_temporary(model: str | None) -> Path:
    """`model` (a HF directory or .gguf file; None: the embedded model) prepared into a temporary OUT directory."""
    from .extras import GGUF, is_gguf_source, require_extra

    if is_gguf_source(model):
        require_extra("gguf", GGUF, "--local-only (reading a GGUF model; the default is one)")
    from .model.prepare import prepare
    from .model.source import load_source

    shards = Path(tempfile.mkdtemp(prefix="splitinfer-local-"))
    prepare(load_source(model), shards, 1, 1, "float32")
    return shards
