"""The local half of one conversation: head and tail caches, the cloud session, lazy commit, recovery.

`run_block` turns q tokens into q logits rows through head -> cloud -> tail in one round trip; `commit`
names the accepted rows, which are kept locally at once and on the cloud by the next request's `keep`
list (no extra round trip). The session keeps what it sent for every committed row, so when the cloud
loses the session (TTL, restart, dropped link) it reconnects, re-sends those rows and carries on: the
local caches are untouched and the output does not change.

Its head depth k is the one its middle pins in the hello (split-point randomisation; the client draws it
per session), or the shard's fixed split; it runs layers [0, k) and never changes k, reconnects included.

It knows nothing about tokenization or about how blocks are chosen (decoding strategies do that).
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

import torch

from ..errors import ProtocolError, SessionError, TransportError
from ..masks import BlockStructure
from ..model.shards import LocalHalf
from ..telemetry import StepRecord
from ..wire.messages import Step

log = logging.getLogger("splitinfer.local")


@dataclass(frozen=True)
class ClientConfig:
    wire_dtype: str = "float16"  # dtype of hidden states on the wire (float32 for bit-exact tests)
    prefill_chunk: int = 512  # rows per prefill message; bounded further by the server's limits
    max_retries: int = 5  # reconnect attempts per step before giving up
    retry_backoff_s: float = 0.25  # first backoff; doubles on each attempt
    retry_backoff_max_s: float = 8.0  # the doubling stops here, so a long outage is polled, not waited out
    # Split-point randomisation: seeds the per-session draw of the head depth. None (the default) draws
    # from the OS's secret RNG; a seed is for tests and benchmarks only (it makes the depth predictable).
    split_seed: int | None = None

    def backoff_s(self, attempt: int) -> float:
        """Delay before reconnect `attempt` (0-based): exponential, capped, with jitter in [1/2, 1] of it so
        that clients cut off together (a server restart) do not all come back in the same instant."""
        return min(self.retry_backoff_s * (2**attempt), self.retry_backoff_max_s) * random.uniform(0.5, 1.0)


class SplitSession:
    def __init__(self, local: LocalHalf, middle, config: ClientConfig = ClientConfig()):
        self.local = local
        self.middle = middle
        self.config = config
        pinned = getattr(middle, "head_layers", None)
        self.head_layers = local.head_range[0] if pinned is None else pinned  # k; the server checks its range
        self.head = local.head_for(self.head_layers)
        self.head_cache = self.head.new_cache()
        self.tail_cache = local.tail.new_cache()
        self.length = 0  # committed tokens
        self.records: list[StepRecord] = []
        self._device = next(local.embed.parameters()).device
        self._seq = 0
        self._keep_next: tuple[int, ...] = ()  # rows of the cloud's pending block to keep next time
        self._sent: list[torch.Tensor] = []  # [rows, d] head outputs of committed rows, in order
        self._pending_sent: torch.Tensor | None = None
        self._pending_q = 0
        self._session_id: str | None = None
        self._connected = False

    # -- one block through the whole model ---------------------------------------------------------
    def run_block(
        self,
        tokens: list[int],
        structure: BlockStructure,
        kind: str = "decode",
        logits_from: int = 0,
        depths: list[int] | None = None,
    ) -> torch.Tensor:
        """tokens: q ids of the block -> logits [q - logits_from, vocab] float32 for rows logits_from..q-1.

        The block stays pending until `commit`. Prefill asks for few rows: the LM head is the most
        expensive local layer, and most prompt rows need no logits. depths: each row's distance from the
        committed sequence, for matrix blocks whose rows are not consecutive (default: 0..q-1).
        """
        assert self._pending_q == 0, "commit the previous block first"
        q = len(tokens)
        depths = structure.depths(q) if depths is None else depths
        positions = [self.length + d for d in depths] if depths is not None else list(range(self.length, self.length + q))
        record = StepRecord(kind=kind, rows=q, accepted=0)
        t0 = time.perf_counter()
        ids = torch.tensor([tokens], dtype=torch.long, device=self._device)
        pos = torch.tensor(positions, dtype=torch.long, device=self._device)
        allowed = structure.allowed(q)
        with torch.inference_mode():
            hidden = self.head(self.local.embed(ids), pos, allowed, self.head_cache)  # [1, q, d]
        sent = hidden[0]
        t1 = time.perf_counter()
        returned = self._remote(positions, structure, sent, record)  # [q, d]
        t2 = time.perf_counter()
        with torch.inference_mode():
            out = self.local.tail(returned.to(self._device, hidden.dtype)[None], pos, allowed, self.tail_cache)
            logits = self.local.logits(out[:, logits_from:])
        t3 = time.perf_counter()
        record.local_ms = ((t1 - t0) + (t3 - t2)) * 1e3
        self.records.append(record)
        self._pending_sent, self._pending_q = sent, q
        return logits

    def commit(self, rows: list[int]) -> None:
        """Accept `rows` of the pending block (a contiguous path from its first row)."""
        assert self._pending_q, "no pending block"
        self.head_cache.keep(rows)
        self.tail_cache.keep(rows)
        if rows:
            self._sent.append(self._pending_sent[rows])
        self._keep_next = tuple(rows)
        self.length += len(rows)
        if self.records[-1].kind == "decode":
            self.records[-1].accepted = len(rows)
        self._pending_sent, self._pending_q = None, 0

    def uncommit(self, rows: int) -> bool:
        """Forget the last `rows` committed rows if they all came from the last block; False otherwise.

        Decoding can stop inside an accepted path (a token limit, an end-of-sequence token or a stop
        string among the accepted drafts), leaving rows in the caches that the conversation never
        emitted. The last block's rows reach the cloud's cache only with the next request's keep list
        (lazy commit), so shortening that list and truncating the local caches drops them on both sides
        with no round trip.
        """
        assert self._pending_q == 0, "commit the pending block first"
        if rows <= 0:
            return True
        if rows > len(self._keep_next) or not self._sent:
            return False
        self._keep_next = self._keep_next[: len(self._keep_next) - rows]
        self.length -= rows
        self.head_cache.truncate(self.length)
        self.tail_cache.truncate(self.length)
        self._sent[-1] = self._sent[-1][: self._sent[-1].shape[0] - rows]
        return True

    def prefill(self, tokens: list[int], logits_rows: int = 1) -> torch.Tensor:
        """Run and commit `tokens` in chunks; returns logits [min(logits_rows, len), vocab] of the last rows."""
        first_wanted = len(tokens) - max(1, min(logits_rows, len(tokens)))
        chunk = self._chunk_rows()
        parts = []
        for start in range(0, len(tokens), chunk):
            part = tokens[start : start + chunk]
            logits_from = min(max(first_wanted - start, 0), len(part))
            logits = self.run_block(part, BlockStructure.chain(), kind="prefill", logits_from=logits_from)
            if logits.shape[0]:
                parts.append(logits)
            self.commit(list(range(len(part))))
        return torch.cat(parts)

    def _chunk_rows(self) -> int:
        chunk = self.config.prefill_chunk
        welcome = getattr(self.middle, "welcome", None)
        if welcome is not None:
            width = self.local.config.hidden_size * 4  # worst case: float32 wire
            chunk = min(chunk, welcome.max_block_rows, max(1, (welcome.max_message_bytes - 65536) // width))
        return max(1, chunk)

    # -- the cloud, with recovery ------------------------------------------------------------------
    def _remote(self, positions: list[int], structure: BlockStructure, hidden: torch.Tensor, record: StepRecord) -> torch.Tensor:
        attempt = 0
        while True:
            try:
                if not self._connected:
                    self._connect(record)
                step = Step(self._seq, self._keep_next, tuple(positions), structure, hidden, self.config.wire_dtype)
                result, io = self.middle.step(step)
                if result.committed != self.length:  # an untrusted server must agree on what was committed
                    raise ProtocolError(
                        f"the server reports {result.committed} committed rows where this client has {self.length}; "
                        "it is out of step or misbehaving, so its output cannot be trusted."
                    )
                self._seq += 1
                record.round_trip_ms += io.round_trip_ms
                record.serialize_ms += io.serialize_ms
                record.bytes_up += io.bytes_up
                record.bytes_down += io.bytes_down
                record.cloud_compute_ms += result.compute_ms
                record.server_ms += result.handle_ms
                return result.hidden
            except (SessionError, TransportError) as exc:
                self._connected = False
                if attempt >= self.config.max_retries:
                    raise
                delay = self.config.backoff_s(attempt)
                log.warning("cloud session lost (%s); reconnecting in %.2f s", exc, delay)
                time.sleep(delay)
                attempt += 1
                record.recoveries += 1

    def _connect(self, record: StepRecord) -> None:
        welcome = self.middle.open(resume_id=self._session_id)
        cloud_committed = self.length - len(self._keep_next)
        if welcome.resumed and welcome.committed == cloud_committed and welcome.next_seq == self._seq:
            self._connected = True
            return
        if welcome.resumed:  # the server's state is not ours (it ran a step we never saw answered)
            self.middle.close(end_session=True)
            welcome = self.middle.open(resume_id=None)
        self._session_id, self._seq, self._connected = welcome.session_id, welcome.next_seq, True
        self._keep_next = ()
        self._resend_history(record)

    def _resend_history(self, record: StepRecord) -> None:
        """Rebuild the cloud cache from the rows sent before; the replies are not needed (tail has them)."""
        if not self._sent:
            return
        history = torch.cat(self._sent)
        chunk = self._chunk_rows()
        for start in range(0, history.shape[0], chunk):
            rows = history[start : start + chunk]
            positions = tuple(range(start, start + rows.shape[0]))
            step = Step(self._seq, self._keep_next, positions, BlockStructure.chain(), rows, self.config.wire_dtype)
            result, io = self.middle.step(step)
            self._seq += 1
            self._keep_next = tuple(range(rows.shape[0]))
            record.bytes_up += io.bytes_up
            record.bytes_down += io.bytes_down
        # A compacted history is one tensor from now on.
        self._sent = [history]
        log.info("re-prefilled %d rows into a new cloud session", history.shape[0])

    def close(self) -> None:
        self.middle.close(end_session=True)
        self._connected = False
