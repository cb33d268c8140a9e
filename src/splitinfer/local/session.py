"""The local half of one conversation: head -> link -> tail, then commit.

`run_block` turns q tokens into q logits rows in one round trip: the head's hidden states go through
the link to the cloud's middle layers and come back into the tail. The decoding loop drives it as a
`Verifier` (decoding/verifier.py): `send_block`, `receive_block`, `resolve`; one block at a time goes
through `run_block` and `commit`. `commit` names the accepted rows,
kept locally at once and on the cloud by the next request's keep list (lazy commit, no extra round
trip). Which message goes when (hello, resume, seq, keep, re-sending the history into a fresh session
after a loss) is the link's decision (wire/clientlink.py); this module only carries its messages over the
middle (wire/transport.py) and sleeps between reconnects (`_recover`, the one backoff). The local caches are never touched by a
recovery, so the output does not change.

Blocks in flight (`ClientConfig.in_flight` > 1 or `AUTO_IN_FLIGHT`, a v3 server, a middle that can `post`;
pinned, or up to MAX_IN_FLIGHT as decoding/ahead.py judges worth it): `send_block` runs
the head on a block that assumes the unresolved blocks before it kept given rows (the head cache holds
them, wire/inflight.py builds the mask) and sends it without waiting; `receive_block` takes the oldest
reply through the tail; `resolve` commits its kept rows on both local caches and tells the link;
`drop_unresolved` forgets the blocks whose assumption failed. The tail cache only ever sees resolved
blocks, in order, so it never holds more than one pending block. A loss with blocks in flight drops them
all and rebuilds the cloud session from the committed history; the decoding loop sends again from there.
A server from before v3 refuses the hello, and the session goes on one block at a time.

Its head depth k is the one its middle pins in the hello (split-point randomisation; the client draws it
per session), or the shard's fixed split; it runs layers [0, k) and never changes k, reconnects included.

It knows nothing about tokenization or about how blocks are chosen (decoding strategies do that).
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from ..errors import ConfigError, Draining, SessionError, TransportError, VersionMismatch
from ..masks import BlockStructure
from ..model.shards import LocalHalf
from ..telemetry import StepRecord
from ..wire.inflight import Prefix, prefix_mask
from ..wire.clientlink import Answered, Block, ClientLink, Open
from ..wire.frame import wire_dtype_of
from ..wire.link import Client
from ..wire.messages import MAX_HOLD_MS, PIPELINE_VERSION, Close
from ..wire.transport import Middle

log = logging.getLogger("splitinfer.local")
DRAFTER_MODES = ("auto", "off")
MAX_IN_FLIGHT = 3
AUTO_IN_FLIGHT = 0  # ClientConfig.in_flight (--in-flight auto): the controller chooses, up to MAX_IN_FLIGHT


@dataclass
class _Ahead:
    """A block sent ahead and not resolved yet, as the local side keeps it."""

    positions: tuple[int, ...]
    allowed: np.ndarray  # [q, q] bool
    record: StepRecord
    sent: torch.Tensor  # [q, d] the head layers' output, as it left for the wire (a fused draft head reads it)


@dataclass(frozen=True)
class ClientConfig:
    # dtype of hidden states on the wire; None: the one `prepare` recorded in the local shard (float16, or
    # bfloat16 for Gemma 3, whose activations overflow float16); float32 for bit-exact tests
    wire_dtype: str | None = None
    prefill_chunk: int = 512  # rows per prefill message; bounded further by the server's limits
    max_retries: int = 5  # reconnect attempts per step before giving up
    retry_backoff_s: float = 0.25  # first backoff; doubles on each attempt
    retry_backoff_max_s: float = 8.0  # the doubling stops here, so a long outage is polled, not waited out
    # Split-point randomisation: seeds the per-session draw of the head depth. None (the default) draws
    # from the OS's secret RNG; a seed is for tests and benchmarks only (it makes the depth predictable).
    split_seed: int | None = None
    # The learned draft head in the local shard's drafter/ directory: "auto" uses it when present and made
    # for this model, "off" never loads it.
    drafter: str = "auto"
    # Blocks in flight at once (1-3): with 2 or more, the next block goes out before the previous one's result
    # is back, assuming its most likely outcome; needs a server that speaks protocol v3 (else 1 is used).
    # AUTO_IN_FLIGHT (0): up to MAX_IN_FLIGHT, each block ahead only when its measured costs say it pays.
    in_flight: int = 1
    # Pad every step and its reply to multiples of this many rows (wire/padding.py), so a network observer
    # cannot read block sizes or accepted counts from message sizes (threat T6); 0: off. Output is unchanged.
    pad_rows: int = 0
    # Pad every prompt chunk (and replayed history) and its reply to multiples of this many rows instead, so
    # prompts shorter than it look alike on the wire (their length carried the category best, docs/privacy.md
    # T6); 0: prompts are padded as steps are.
    pad_prompt_rows: int = 0
    # Pad every reply's decode exchanges to a multiple of this many with cover exchanges (wire/cover.py), so
    # an observer cannot count the steps a reply took, which follows how predictable its text was (T6); 0: off.
    # Costs up to this many extra round trips a reply; output is unchanged.
    pad_steps: int = 0
    # Timing padding (T6): the server holds every step's reply until this many ms after the step arrived, so its
    # pass time does not show (a pass that takes longer still does); 0: off.
    pad_hold_ms: int = 0
    # ... and the client sends every step no sooner than this many ms after the previous reply, so its own
    # compute does not show; one block at a time only; 0: off.
    pad_think_ms: int = 0

    def __post_init__(self):
        if self.drafter not in DRAFTER_MODES:
            raise ValueError(f"drafter must be one of {', '.join(DRAFTER_MODES)}, not {self.drafter!r}")
        if not (1 <= self.in_flight <= MAX_IN_FLIGHT or self.in_flight == AUTO_IN_FLIGHT):
            raise ConfigError(f"--in-flight must be between 1 and {MAX_IN_FLIGHT} blocks, or auto, not {self.in_flight}.")
        if self.pad_rows < 0 or self.pad_prompt_rows < 0:
            raise ConfigError(f"--pad-rows and --pad-prompt-rows must be 0 (off) or positive row counts, not "
                              f"{self.pad_rows} and {self.pad_prompt_rows}.")
        if min(self.pad_steps, self.pad_hold_ms, self.pad_think_ms) < 0 or self.pad_hold_ms > MAX_HOLD_MS:
            raise ConfigError(f"--pad-steps, --pad-hold-ms and --pad-think-ms must be 0 (off) or positive (a hold at "
                              f"most {MAX_HOLD_MS} ms), not {self.pad_steps}, {self.pad_hold_ms} and {self.pad_think_ms}.")
        if self.pad_think_ms and self.in_flight != 1:
            raise ConfigError("--pad-think-ms paces one block at a time; use it with --in-flight 1.")

    def backoff_s(self, attempt: int) -> float:
        """Delay before reconnect `attempt` (0-based): exponential, capped, with jitter in [1/2, 1] of it so
        that clients cut off together (a server restart) do not all come back in the same instant."""
        return min(self.retry_backoff_s * (2**attempt), self.retry_backoff_max_s) * random.uniform(0.5, 1.0)


def with_shard_wire_dtype(config: ClientConfig, manifest: dict) -> ClientConfig:
    """`config` with the wire dtype the local shard records, where the caller left it unset."""
    return config if config.wire_dtype is not None else replace(config, wire_dtype=wire_dtype_of(manifest))


class SplitSession:
    """One conversation's split forward pass; a context manager that ends the cloud session on exit."""

    def __init__(self, local: LocalHalf, middle: Middle, config: ClientConfig = ClientConfig()):
        self.local = local
        self.middle = middle
        self.config = config = with_shard_wire_dtype(config, local.manifest)
        pinned = middle.head_layers
        self.head_layers = local.head_range[0] if pinned is None else pinned  # k; the server checks its range
        self.head = local.head_for(self.head_layers)
        self.head_cache = self.head.new_cache()
        self.tail_cache = local.tail.new_cache()
        self.link = ClientLink(config.wire_dtype, config.max_retries, config.prefill_chunk, config.pad_rows,
                               config.pad_prompt_rows, config.pad_hold_ms)
        self._replied_at = 0.0  # perf_counter time of the last reply: --pad-think-ms paces the next send from it
        self.records: list[StepRecord] = []
        self._device = next(local.embed.parameters()).device
        self._pending_q = 0
        self._features: torch.Tensor | None = None  # [q, d] tail output of the last block, before the final norm
        # the states that crossed the wire, by HF index, of the last block (one dict) or each prefill chunk
        self._wire: list[dict[int, torch.Tensor]] = []
        # Blocks in flight need a transport that sends without waiting; others go one block at a time.
        wanted = MAX_IN_FLIGHT if config.in_flight == AUTO_IN_FLIGHT else config.in_flight
        self._pipelining = wanted > 1 and middle.sends_ahead
        self._depth = wanted
        if self._pipelining:
            self.link.version = PIPELINE_VERSION
        self._ahead: list[_Ahead] = []  # blocks sent ahead and not resolved, oldest first
        self._received: tuple[float, float] = (0.0, 0.0)  # (cloud compute, tail) ms of the last block received
        self._done: torch.Tensor | None = None  # logits of a block sent with `wait`, until `receive_block`

    @property
    def length(self) -> int:
        """Committed tokens."""
        return self.link.committed

    def __enter__(self) -> "SplitSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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
        positions = _positions(self.length, structure, q, depths)
        record = StepRecord(kind=kind, rows=q, accepted=0)
        t0 = time.perf_counter()
        ids = torch.tensor([tokens], dtype=torch.long, device=self._device)
        pos = torch.tensor(positions, dtype=torch.long, device=self._device)
        allowed = structure.allowed(q)
        with torch.inference_mode():
            hidden = self.head(self.local.embed(ids), pos, allowed, self.head_cache)  # [1, q, d]
        head_ms = (time.perf_counter() - t0) * 1e3
        block = Block(tuple(positions), structure, hidden[0], prefill=kind == "prefill")
        returned = self._through_link(block, record)  # [q, d]
        logits, tail_ms = self._tail(returned, pos, allowed, hidden.dtype, logits_from, sent=hidden[0])
        record.local_ms = head_ms + tail_ms
        self._received = (record.cloud_compute_ms, tail_ms)
        self.records.append(record)
        self._pending_q = q
        return logits

    def _tail(self, returned: torch.Tensor, pos: torch.Tensor, allowed, dtype: torch.dtype, logits_from: int = 0, *,
              sent: torch.Tensor):
        """The cloud's answer [q, d] through the tail: (logits [q - logits_from, vocab], the tail's ms); keeps the
        block's final features, and the states that crossed the wire (`sent`: the head layers' output), for
        `features`."""
        t0 = time.perf_counter()
        with torch.inference_mode():
            received = returned.to(self._device, dtype)
            out = self.local.tail(received[None], pos, allowed, self.tail_cache)
            logits = self.local.logits(out[:, logits_from:])
        self._features = out[0]
        self._wire = [{self.head_layers: sent, self.local.tail.start: received}]
        return logits, (time.perf_counter() - t0) * 1e3

    def features(self, states: tuple[int, ...] = ()) -> torch.Tensor:
        """[q, d (1 + len(states))]: the final features before the final norm of the last block's rows (all
        rows of the last prefill), then the hidden states `states` (HF numbering) of the same rows, of the two
        that crossed the wire (state k, sent; state N - m, received): a draft head's input, kept on the
        trusted side. ConfigError for a state this session's split does not send or receive."""
        assert self._features is not None, "no block has run yet"
        missing = [i for i in states if i not in self._wire[0]]
        if missing:
            raise ConfigError(
                f"the draft head reads hidden states {list(states)}, but this session sends state {self.head_layers} "
                f"and receives state {self.local.tail.start}: it was trained for another split (shards prepared with "
                "--split-range draw the head depth per session). Install a head trained without --fuse, or prepare "
                "the shards with the fixed split the head was trained on.")
        wire = (torch.cat([chunk[i] for chunk in self._wire]).to(self._features.dtype) for i in states)
        return torch.cat([self._features, *wire], dim=-1)

    def commit(self, rows: list[int]) -> None:
        """Accept `rows` of the pending block (a contiguous path from its first row)."""
        assert self._pending_q, "no pending block"
        self.head_cache.keep(rows)
        self.tail_cache.keep(rows)
        self.link.commit(rows)
        self._pending_q = 0
        if self.records[-1].kind == "decode":
            self.records[-1].accepted = len(rows)

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
        if not self.link.uncommit(rows):
            return False
        self.head_cache.truncate(self.length)
        self.tail_cache.truncate(self.length)
        return True

    def prefill(self, tokens: list[int], logits_rows: int = 1) -> torch.Tensor:
        """Run and commit `tokens` in chunks; returns logits [min(logits_rows, len), vocab] of the last rows."""
        first_wanted = len(tokens) - max(1, min(logits_rows, len(tokens)))
        chunk = self.link.max_rows(self.config.prefill_chunk, self.local.config.hidden_size * 4)  # worst case: float32
        parts, features, wire = [], [], []
        for start in range(0, len(tokens), chunk):
            part = tokens[start : start + chunk]
            logits_from = min(max(first_wanted - start, 0), len(part))
            logits = self.run_block(part, BlockStructure.chain(), kind="prefill", logits_from=logits_from)
            if logits.shape[0]:
                parts.append(logits)
            self.commit(list(range(len(part))))
            features.append(self._features)
            wire += self._wire
        self._features = torch.cat(features)
        self._wire = wire  # joined only when a fused draft head asks (`features`)
        return torch.cat(parts)

    # -- blocks in flight ----------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        """Blocks this session may have in flight at once: the configured number where the transport and the
        server allow it (known once the session is open), else 1."""
        if not self._pipelining or self.link.welcome is None:
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
        positions = _positions(self.length + sum(len(rows) for rows in assume), structure, q, depths)
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
        while True:
            try:
                message = self.link.next_send()
                if isinstance(message, Open):
                    self.link.on_welcome(self._open(message.resume_id))
                elif isinstance(message, Close):
                    self.middle.close(end_session=True)
                elif self.link.state is Client.FLYING:
                    self.middle.post(message)
                    return True
                else:  # history re-sent into a fresh session
                    self.link.on_result(self.middle.step(message)[0])
            except (SessionError, TransportError) as exc:
                if not self._lost(exc, record):
                    return False

    def _lost(self, exc: Exception, record: StepRecord) -> bool:
        """After a loss: True when the block being sent is still submitted (the loss came before it could go),
        False when every block in flight, that one included, is gone."""
        self._recover(exc, record)
        if self.link.live or self.link.submitted:
            return True
        self._forget_ahead()
        return False

    def _recover(self, exc: Exception, record: StepRecord) -> None:
        """The one reconnect rule: tell the link the session was lost, then back off before it reconnects;
        re-raise `exc` once the link has used up its attempts. A draining server is no fault: no attempt, no wait."""
        drained = isinstance(exc, Draining)
        attempt = self.link.lost(counted=not drained)
        if attempt is None:
            raise exc
        delay = 0.0 if drained else self.config.backoff_s(attempt)
        log.warning("cloud session lost (%s); reconnecting in %.2f s", exc, delay)
        time.sleep(delay)
        record.recoveries += 1

    def receive_block(self) -> torch.Tensor | None:
        """The oldest unresolved block's logits [q, vocab] float32 (through the tail); None when the link was
        lost and every block in flight with it."""
        if self._done is not None:  # a block that went through the whole model when sent
            logits, self._done = self._done, None
            return logits
        ahead = self._ahead[0]
        while True:
            try:
                result, io = self.middle.collect()
                answer = self.link.on_result(result)
            except (SessionError, TransportError) as exc:
                self._lost(exc, ahead.record)
                return None
            if answer is not None:  # else the reply to a block dropped meanwhile
                break
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
        while self.link.flying:
            try:
                self.link.on_result(self.middle.collect()[0])
            except (SessionError, TransportError):
                self.link.lost()  # the next step reconnects and rebuilds the cloud session
                return

    def pad_exchanges(self, first_record: int) -> int:
        """Send cover exchanges (wire/cover.py) until the exchanges since record `first_record`, prompt chunks
        aside, are a multiple of `config.pad_steps`; returns how many were sent. Each has the sizes most of
        those steps had and is held by the server for `pad_hold_ms` (else their median pass); it follows the
        last reply by `pad_think_ms` (else their median local time), so on the wire it looks like one more
        step. Best effort: a lost link ends the padding (logged)."""
        steps = [r for r in self.records[first_record:] if r.kind != "prefill"]
        missing = -len(steps) % self.config.pad_steps if self.config.pad_steps and steps else 0
        if not missing:
            return 0
        up, down = _most_common([(r.bytes_up, r.bytes_down) for r in steps])
        hold = self.config.pad_hold_ms or float(np.median([r.server_ms for r in steps]))
        think = 0.0 if self.config.pad_think_ms else float(np.median([r.local_ms for r in steps]))
        for sent in range(missing):
            time.sleep(think / 1e3)
            self._pace()
            t0 = time.perf_counter()
            try:
                self.middle.cover(up, down, hold)
            except TransportError as exc:
                log.warning("cover exchanges stopped after %d of %d: %s", sent, missing, exc)
                return sent
            self._replied_at = time.perf_counter()
            self.records.append(StepRecord("cover", 0, 0, local_ms=think, round_trip_ms=(self._replied_at - t0) * 1e3,
                                           server_ms=hold, bytes_up=up, bytes_down=down))
        return missing

    def _pace(self) -> None:
        """--pad-think-ms: wait until that long after the last reply, so the next send does not show the
        client's compute."""
        wait = self._replied_at + self.config.pad_think_ms / 1e3 - time.perf_counter()
        if self.config.pad_think_ms and wait > 0:
            time.sleep(wait)

    # -- the link's messages over the middle, with reconnects ------------------------------------------
    def _through_link(self, block: Block, record: StepRecord) -> torch.Tensor:
        """The cloud's [q, d] answer to `block`, reconnecting (with backoff) as often as the link allows."""
        self.link.submit(block)
        while True:
            try:
                answer = self._send_next(record)
                if answer is not None:
                    return answer.result.hidden
            except (SessionError, TransportError) as exc:
                self._recover(exc, record)

    def _send_next(self, record: StepRecord) -> Answered | None:
        """Send what the link asks for and hand it the reply; the block's answer, or None before it."""
        message = self.link.next_send()
        if isinstance(message, Open):
            self.link.on_welcome(self._open(message.resume_id))
            return None
        if isinstance(message, Close):
            self.middle.close(end_session=True)
            return None
        self._pace()
        result, io = self.middle.step(message)
        self._replied_at = time.perf_counter()
        reply = self.link.on_result(result)
        record.bytes_up += io.bytes_up
        record.bytes_down += io.bytes_down
        if not isinstance(reply, Answered):  # history re-sent: the tail has its replies already
            if reply.done:
                log.info("re-prefilled %d rows into a new cloud session", self.length)
            return None
        record.round_trip_ms += io.round_trip_ms
        record.serialize_ms += io.serialize_ms
        record.cloud_compute_ms += result.compute_ms
        record.server_ms += result.handle_ms
        return reply

    def _open(self, resume_id: str | None):
        welcome = self._hello(resume_id)
        self._replied_at = time.perf_counter()  # the welcome is a reply too: the prompt's send is paced from it
        return welcome

    def _hello(self, resume_id: str | None):
        if self.link.version is None:
            return self.middle.open(resume_id=resume_id)
        try:
            return self.middle.open(resume_id=resume_id, version=self.link.version)
        except VersionMismatch:
            log.info("the server predates blocks in flight (protocol v%d); one block at a time", PIPELINE_VERSION)
            self.link.version, self._pipelining = None, False
            return self.middle.open(resume_id=resume_id)

    def close(self) -> None:
        """End the cloud session (best effort) and the link; safe to call more than once."""
        self.middle.close(end_session=True)
        self.link.close()


def _most_common(values: list):
    """The value seen most often (the first seen among ties)."""
    return max(dict.fromkeys(values), key=values.count)


def _positions(base: int, structure: BlockStructure, q: int, depths: list[int] | None) -> list[int]:
    """Each row's position: `base` plus its depth (given, else the structure's, else 0..q-1)."""
    depths = structure.depths(q) if depths is None else depths
    return [base + d for d in depths] if depths is not None else list(range(base, base + q))
