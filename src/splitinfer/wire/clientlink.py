"""The client's side of the link protocol, sans-I/O: which message goes next, and what a reply must say.

`ClientLink` is one conversation's cloud session as the client sees it. It decides the hello (a new
session, or resume the last one), judges the welcome against what the client committed, numbers the steps
(seq), carries the lazy-commit keep list, re-sends the committed history into a fresh session after a
loss, and checks that every result answers the step it was sent for. With blocks in flight (protocol v3,
`submit_ahead`) it sends steps before the earlier ones are answered, names the earlier unresolved blocks
each one assumes accepted, resolves them oldest first and drops the ones whose assumption failed; a loss
with blocks in flight rebuilds the session from the committed history. A driver (local/session.py) asks
`next_send()` what to send, sends it, and feeds the reply back; the link never touches a socket, runs no
model and never sleeps, so every rule here is testable with plain tensors.

Its transitions are the client's rows of link.py's one table (`TRANSITIONS`), read through
`link.transition`; the server's rules are in link.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ProtocolError
from ..masks import BlockStructure
from . import link
from .link import Client
from .frame import DEFAULT_WIRE_DTYPE, WIRE_DTYPES
from .messages import PIPELINE_VERSION, Assumed, Close, Result, Step, Welcome


@dataclass(frozen=True)
class Open:
    """Send a hello: resume `resume_id` when set, else ask for a new session."""

    resume_id: str | None


@dataclass(frozen=True)
class Answered:
    """The block's result arrived and agrees with this client."""

    result: Result


@dataclass(frozen=True)
class Replayed:
    """One chunk of history was re-sent; `done` when the fresh session holds all of it."""

    rows: int
    done: bool


@dataclass(frozen=True)
class Block:
    """One block's hidden states for the cloud: positions and structure as the step carries them."""

    positions: tuple[int, ...]
    structure: BlockStructure
    hidden: torch.Tensor  # [q, d] head outputs
    prefill: bool = False  # a prompt chunk: padded to the prompt ladder (pad_prompt_rows) where one is set


@dataclass(eq=False)
class _Flight:
    """A block sent ahead (v3): its head outputs, and what its reply must report."""

    seq: int
    hidden: torch.Tensor  # [q, d] head outputs
    committed: int  # the cloud's committed rows once this step's keep list is applied
    wanted: bool = True  # False once dropped: its reply, when it comes, is discarded
    answered: bool = False


# The defaults of the client's link, written once: ClientConfig (local/config.py) takes its own from these.
MAX_RETRIES = 5  # reconnects per block before a loss is raised
ROWS_PER_MESSAGE = 512  # rows per prompt chunk and per re-sent history chunk, bounded further by the server


class ClientLink:
    """The client's side of one cloud session. See the module docstring for what it decides."""

    def __init__(self, wire_dtype: str = DEFAULT_WIRE_DTYPE, max_retries: int = MAX_RETRIES,
                 replay_rows: int = ROWS_PER_MESSAGE, pad_rows: int = 0, pad_prompt_rows: int = 0, hold_ms: int = 0):
        self.wire_dtype = wire_dtype
        self.pad_rows = pad_rows  # every step and its reply padded to multiples of this many rows (padding.py); 0: off
        self.pad_prompt_rows = pad_prompt_rows  # the same for prompt chunks and replayed history; 0: as pad_rows
        self.hold_ms = hold_ms  # every step asks its reply held this long after it arrives (T6 timing); 0: off
        self.max_retries = max_retries  # reconnects per block before the loss is raised
        self.replay_rows = replay_rows  # rows per re-sent history chunk, bounded by the welcome's limits
        self.state = Client.IDLE
        self.session_id: str | None = None  # the session to resume after a loss
        self.welcome: Welcome | None = None  # the last welcome: the server's limits
        self.seq = 0  # seq of the next step
        self.keep: tuple[int, ...] = ()  # rows of the cloud's pending block that the next step keeps
        self.committed = 0  # rows this client committed
        self._history: list[torch.Tensor] = []  # [rows, d] head outputs of committed rows, in order
        self._replay: torch.Tensor | None = None  # [committed, d] history being re-sent
        self._replay_at = 0
        self._block: Block | None = None
        self._pending: torch.Tensor | None = None  # [q, d] the answered block's head outputs
        self._sent: Step | None = None  # the step awaiting its result
        self._attempts = 0  # losses since the last answered block
        self.version: int | None = None  # the hello's version: PIPELINE_VERSION to ask for blocks in flight
        self.max_in_flight = 1  # blocks this session may have in flight at once (the welcome's; 1 before v3)
        self._assume: tuple[tuple[int, ...], ...] | None = None  # the submitted block's assumed rows, per live block
        self._flight: list[_Flight] = []  # steps sent ahead and not answered yet, oldest first
        self._live: list[_Flight] = []  # blocks sent ahead, neither resolved nor dropped, oldest first
        self._to_resolve = False  # the cloud's oldest pending block is resolved here; the next step says so
        self._also: list[Assumed] = []  # blocks resolved here after that one, in order: the next step commits them too
        self._rebuild = False  # blocks in flight were lost: open a fresh session rather than resume

    def _move(self, event: str) -> None:
        self.state = link.transition(self.state, event)

    def max_rows(self, wanted: int, row_bytes: int) -> int:
        """Rows per message: `wanted`, bounded by the last welcome's row and byte limits."""
        if self.welcome is not None:
            fit = max(1, (self.welcome.max_message_bytes - 65536) // row_bytes)  # 64 KiB for the header
            wanted = min(wanted, self.welcome.max_block_rows, fit)
        return max(1, wanted)

    def submit(self, block: Block) -> None:
        """The next block to send; `next_send` opens or rebuilds the session first if it must."""
        assert self._block is None and self.state is not Client.PENDING, "commit the previous block first"
        self._block = block

    def next_send(self) -> Open | Close | Step:
        """What to send now. Every returned message is taken as sent."""
        if self.state is Client.IDLE:
            self._move("send_hello")
            return Open(self.session_id)
        if self.state is Client.STALE:
            self._move("send_close")
            self.session_id = None
            return Close()
        if self.state is Client.REPLAYING and self._replay is not None and self._replay_at < self._replay.shape[0]:
            self._move("send_replay")
            chunk = self.max_rows(self.replay_rows, self._replay.shape[1] * 4)  # 4 bytes a value: a float32 wire at worst
            rows = self._replay[self._replay_at : self._replay_at + chunk]
            positions = tuple(range(self._replay_at, self._replay_at + rows.shape[0]))
            return self._step(positions, BlockStructure.chain(), rows, prefill=True)
        if self.state is Client.REPLAYING:
            self._move("replayed")
        if self._assume is not None:
            return self._send_ahead()
        self._move("send_block")
        block = self._block
        assert block is not None, "submit a block first"
        return self._step(block.positions, block.structure, block.hidden, block.prefill)

    def _step(self, positions: tuple[int, ...], structure: BlockStructure, hidden: torch.Tensor,
              prefill: bool = False) -> Step:
        also = tuple(self._also)  # left by blocks in flight: committed by this step too
        self._sent = Step(self.seq, self.keep, positions, structure, hidden, self.wire_dtype, also, len(also),
                          self._quantum(hidden, prefill), self.hold_ms)
        return self._sent

    def _quantum(self, hidden: torch.Tensor, prefill: bool = False) -> int:
        """Bytes of `pad_rows` rows (`pad_prompt_rows` for a prompt chunk, where set) of hidden state in the
        wire dtype: the padding ladder's step."""
        rows = self.pad_prompt_rows if prefill and self.pad_prompt_rows else self.pad_rows
        return rows * hidden.shape[1] * WIRE_DTYPES[self.wire_dtype].itemsize

    def on_welcome(self, welcome: Welcome) -> None:
        """The server answered the hello: carry on, end a stale session, or rebuild a fresh one."""
        # the keep list's rows are still pending there, and so are those of blocks resolved after it
        cloud_committed = self.committed - len(self.keep) - sum(len(a.rows) for a in self._also)
        self.welcome = welcome
        self.max_in_flight = welcome.max_in_flight if welcome.version >= PIPELINE_VERSION else 1
        in_step = welcome.committed == cloud_committed and welcome.next_seq == self.seq and not self._rebuild
        if welcome.resumed and in_step:
            self._move("welcome_in_step")
            return
        if welcome.resumed:  # the server ran steps whose replies never came back: its state is not ours
            self._move("welcome_stale")
            return
        self._move("welcome_fresh")
        self.session_id, self.seq, self.keep = welcome.session_id, welcome.next_seq, ()
        self._to_resolve, self._rebuild, self._also = False, False, []
        self._replay = torch.cat(self._history) if self._history else None
        self._replay_at = 0

    def on_result(self, result: Result) -> Answered | Replayed:
        """The reply to the step in flight. Raises ProtocolError when it does not answer that step, or when
        the server's committed rows are not this client's (an untrusted server must agree)."""
        if self.state is Client.FLYING:
            return self._ahead_answered(result)
        sent = self._sent
        assert sent is not None, "no step in flight"
        if result.seq != sent.seq:
            raise ProtocolError("the server's reply does not answer the step that was sent.")
        if result.hidden.shape[0] != sent.hidden.shape[0]:
            raise ProtocolError(
                f"the server returned {result.hidden.shape[0]} rows for a {sent.hidden.shape[0]}-row block."
            )
        if self.state is Client.REPLAY_SENT:
            return self._replay_answered(sent)
        if result.committed != self.committed:
            raise ProtocolError(
                f"the server reports {result.committed} committed rows where this client has {self.committed}; "
                "it is out of step or misbehaving, so its output cannot be trusted."
            )
        self._move("block_result")
        self._also = []
        self.seq += 1
        self._sent, self._pending, self._block, self._attempts = None, self._block.hidden, None, 0
        return Answered(result)

    def _replay_answered(self, sent: Step) -> Replayed:
        self._move("replay_result")
        rows = sent.hidden.shape[0]
        self.seq += 1
        self.keep = tuple(range(rows))
        self._to_resolve = True
        self._replay_at += rows
        self._sent = None
        done = self._replay_at >= self._replay.shape[0]
        if done:  # a compacted history is one tensor from now on
            self._history, self._replay = [self._replay], None
            self._move("replayed")
        return Replayed(rows, done)

    def lost(self, counted: bool = True) -> int | None:
        """The session or the connection was lost: the 0-based reconnect attempt (for the backoff), or
        None when `max_retries` reconnects were spent on this block and the loss should be raised. A loss
        not `counted` (a server that drained: it said so) spends no attempt."""
        if self.state is Client.FLYING:  # which of the steps in flight the server ran is unknown: rebuild
            self._rebuild = True
            self._flight, self._live, self._assume, self._block = [], [], None, None
        self._move("lost")
        self._sent = None
        if self._replay is not None:  # a partly rebuilt session is useless; the next one starts over
            self._replay, self._replay_at = None, 0
        if not counted:
            return self._attempts
        if self._attempts >= self.max_retries:  # give the block up; the next one starts counting afresh
            self._block, self._attempts = None, 0
            return None
        self._attempts += 1
        return self._attempts - 1

    def commit(self, rows: list[int]) -> None:
        """Accept `rows` of the answered block: the next step keeps them on the cloud (lazy commit)."""
        self._move("commit")
        if rows:
            self._history.append(self._pending[rows])
        self.keep = tuple(rows)
        self._to_resolve = True
        self.committed += len(rows)
        self._pending = None

    def uncommit(self, rows: int) -> bool:
        """Forget the last `rows` committed rows if the cloud has not committed them yet (they are all in
        the keep list); False otherwise. Shortening the keep list drops them there with no round trip."""
        if rows <= 0:
            return True
        last = self._also[-1].rows if self._also else self.keep
        if rows > len(last) - bool(self._also) or not self._history:  # a block resolved after `keep` keeps its root
            return False
        self._move("uncommit")
        if self._also:
            self._also[-1] = Assumed(self._also[-1].seq, last[: len(last) - rows])
        else:
            self.keep = self.keep[: len(self.keep) - rows]
        self.committed -= rows
        self._history[-1] = self._history[-1][: self._history[-1].shape[0] - rows]
        return True

    def close(self) -> None:
        self._move("close")

    # -- blocks in flight (v3) ----------------------------------------------------------------------
    @property
    def live(self) -> int:
        """Blocks sent ahead that are neither resolved nor dropped (answered or not)."""
        return len(self._live)

    @property
    def submitted(self) -> bool:
        """A block is submitted and not sent yet."""
        return self._block is not None

    @property
    def flying(self) -> int:
        """Steps sent ahead whose replies have not come yet (dropped ones included)."""
        return len(self._flight)

    def submit_ahead(self, block: Block, assume: list[tuple[int, ...]]) -> None:
        """The next block, sent without waiting for the live blocks' replies: `assume` holds the rows it
        assumes kept of each live block, oldest first (every live block, its positions following from them)."""
        assert self._block is None and self.state is not Client.PENDING, "commit the previous block first"
        assert len(assume) == len(self._live), (len(assume), len(self._live))
        assert len(self._live) < self.max_in_flight, "the session's blocks in flight are all out"
        self._block, self._assume = block, tuple(tuple(rows) for rows in assume)

    def _send_ahead(self) -> Step:
        self._move("send_ahead")
        block, assume = self._block, self._assume
        keep = self.keep if self._to_resolve else ()  # else the step assumes the oldest pending block
        assumed = tuple(self._also) + tuple(Assumed(f.seq, rows) for f, rows in zip(self._live, assume))
        step = Step(self.seq, keep, block.positions, block.structure, block.hidden, self.wire_dtype, assumed,
                    len(self._also), self._quantum(block.hidden), self.hold_ms)
        flight = _Flight(self.seq, block.hidden, self.committed)
        self.seq += 1
        self.keep, self._to_resolve, self._also = (), False, []
        self._flight.append(flight)
        self._live.append(flight)
        self._block = self._assume = None
        return step

    def _ahead_answered(self, result: Result) -> Answered | None:
        """The reply to the oldest step in flight; None when that block was dropped meanwhile."""
        flight = self._flight[0]
        if result.seq != flight.seq:
            raise ProtocolError("the server's reply does not answer the oldest step in flight.")
        if result.skipped and flight.wanted:
            raise ProtocolError(f"the server skipped block {flight.seq}, which no later step of this client dropped.")
        if result.hidden.shape[0] != flight.hidden.shape[0] and not result.skipped:
            raise ProtocolError(
                f"the server returned {result.hidden.shape[0]} rows for a {flight.hidden.shape[0]}-row block."
            )
        self._flight.pop(0)
        self._move("ahead_result" if self._flight else "landed")
        self._attempts = 0
        if not flight.wanted:
            return None
        if result.committed != flight.committed:
            raise ProtocolError(
                f"the server reports {result.committed} committed rows where this client has {flight.committed}; "
                "it is out of step or misbehaving, so its output cannot be trusted."
            )
        flight.answered = True
        return Answered(result)

    def resolve(self, rows: list[int]) -> None:
        """Accept `rows` of the oldest live block (answered): the next step tells the cloud (keep)."""
        flight = self._live[0]
        assert flight.answered, "resolve answered blocks only"
        self._move("resolve")
        self._live.pop(0)
        if rows:
            self._history.append(flight.hidden[rows])
        if self._to_resolve:  # no step went since the last resolution: the next one commits both
            self._also.append(Assumed(flight.seq, tuple(rows)))
        else:
            self.keep, self._to_resolve = tuple(rows), True
        self.committed += len(rows)

    def drop_live(self) -> None:
        """Forget every live block (their assumption failed, or decoding ended): the next step builds on none
        of them, which drops them on the cloud, and their replies are discarded when they come."""
        for flight in self._live:
            flight.wanted = False
        self._live = []
