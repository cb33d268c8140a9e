"""The forward pass of one conversation's split model: head -> link -> tail, then commit.

`run_block` turns q tokens into q logits rows in one round trip: the head's hidden states go through
the link to the cloud's middle layers and come back into the tail. `commit` names the accepted rows,
kept locally at once and on the cloud by the next request's keep list (lazy commit, no extra round
trip); `prefill` runs a prompt in chunks. The decoding loop drives a SplitSession as a `Verifier`
(decoding/verifier.py).

The other jobs live next door, one room each: the messages over the middle, reconnects and replay
(driver.py), blocks in flight (inflight.py, a mixin of this class), cover exchanges (padding.py) and the
typed configuration (config.py). `ClientConfig` and its constants are re-exported here for older imports.

Its head depth k is the one its middle pins in the hello (split-point randomisation; the client draws it
per session), or the shard's fixed split; it runs layers [0, k) and never changes k, reconnects included.

It knows nothing about tokenization or about how blocks are chosen (decoding strategies do that).
"""

from __future__ import annotations

import time

import torch

from ..errors import ConfigError
from ..masks import BlockStructure
from ..model.shards import LocalHalf
from ..telemetry import StepRecord
from ..wire.clientlink import Block, ClientLink
from ..wire.transport import Middle
from .config import AUTO_IN_FLIGHT, DRAFTER_MODES, MAX_IN_FLIGHT, ClientConfig, with_shard_wire_dtype
from .driver import LinkDriver
from .inflight import BlocksInFlight, positions_of
from .padding import pad_exchanges

__all__ = ["AUTO_IN_FLIGHT", "DRAFTER_MODES", "MAX_IN_FLIGHT", "ClientConfig", "SplitSession", "with_shard_wire_dtype"]


class SplitSession(BlocksInFlight):
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
        self.records: list[StepRecord] = []
        self._device = next(local.embed.parameters()).device
        self._pending_q = 0
        self._features: torch.Tensor | None = None  # [q, d] tail output of the last block, before the final norm
        # the states that crossed the wire, by HF index, of the last block (one dict) or each prefill chunk
        self._wire: list[dict[int, torch.Tensor]] = []
        self._init_in_flight()
        # Blocks in flight need a transport that sends without waiting; others go one block at a time.
        self.driver = LinkDriver(self.link, middle, config, pipelining=self._depth > 1 and middle.sends_ahead,
                                 on_gone=self._forget_ahead)

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
        positions = positions_of(self.length, structure, q, depths)
        record = StepRecord(kind=kind, rows=q, accepted=0)
        t0 = time.perf_counter()
        ids = torch.tensor([tokens], dtype=torch.long, device=self._device)
        pos = torch.tensor(positions, dtype=torch.long, device=self._device)
        allowed = structure.allowed(q)
        with torch.inference_mode():
            hidden = self.head(self.local.embed(ids), pos, allowed, self.head_cache)  # [1, q, d]
        head_ms = (time.perf_counter() - t0) * 1e3
        block = Block(tuple(positions), structure, hidden[0], prefill=kind == "prefill")
        returned = self.driver.through(block, record)  # [q, d]
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

    def pad_exchanges(self, first_record: int) -> int:
        """Cover exchanges until this reply's step count is padded (padding.py); how many were sent."""
        return pad_exchanges(self.records, first_record, self.config, self.driver)

    def close(self) -> None:
        """End the cloud session (best effort) and the link; safe to call more than once."""
        self.driver.close()
