"""The link protocol at both ends, sans-I/O: which message goes next, and which ones a peer may send.

Client (`ClientLink`): one conversation's cloud session as the client sees it. It decides the hello
(a new session, or resume the last one), judges the welcome against what the client committed, numbers
the steps (seq), carries the lazy-commit keep list, re-sends the committed history into a fresh session
after a loss, and checks that every result answers the step it was sent for. A driver
(local/session.py) asks `next_send()` what to send, sends it, and feeds the reply back; the link never
touches a socket, runs no model and never sleeps, so every rule here is testable with plain tensors.

Server (`ServerLink`, `check_resume`, `check_step`): the rules a server applies to what a peer sends:
hello before any step, a resume that keeps the session's dtype and head depth, steps in seq order, keep
lists that name a contiguous path continuing the committed sequence, and positions that follow from the
block's structure. cloud/server.py and cloud/sessions.py call them; they hold the state (sessions,
caches), this module holds the rules.

Both ends' transitions are in the one table `TRANSITIONS`; an event it does not list for the current
state is refused with ProtocolError.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from ..errors import ProtocolError
from ..masks import BlockStructure
from .messages import Close, Hello, Probe, Result, Step, Welcome


class Client(Enum):
    IDLE = "idle"  # no session on the current connection: at the start, and after a loss
    OPENING = "opening"  # hello sent, welcome awaited
    STALE = "stale"  # the resumed session is out of step with this client; it is ended before a fresh one
    REPLAYING = "replaying"  # a fresh session: the committed history is re-sent before anything else
    REPLAY_SENT = "replay_sent"  # one chunk of history sent, its result awaited
    READY = "ready"  # the cloud holds exactly what this client committed; a block may go
    BLOCK_SENT = "block_sent"  # the block's step sent, its result awaited
    PENDING = "pending"  # the block came back; it waits for the rows to commit
    CLOSED = "closed"


class Server(Enum):
    AWAIT_HELLO = "await_hello"  # a new connection: only hello, probe or close
    OPEN = "open"  # a session is open on this connection
    CLOSED = "closed"


_AWAITING = (Client.OPENING, Client.REPLAY_SENT, Client.BLOCK_SENT)  # a reply is due: only here can a loss show

# (state, event) -> next state, for both ends. Client events are the link's own decisions ("send_*") and
# what came back; server events are the kinds of message a peer sent.
TRANSITIONS: dict[tuple[Client | Server, str], Client | Server] = {
    (Client.IDLE, "send_hello"): Client.OPENING,  # resume id: the last session's, if any
    (Client.OPENING, "welcome_in_step"): Client.READY,  # resumed with our committed rows and seq
    (Client.OPENING, "welcome_stale"): Client.STALE,  # resumed, but it ran a step whose reply we lost
    (Client.OPENING, "welcome_fresh"): Client.REPLAYING,  # a new session: rebuild it from the history
    (Client.STALE, "send_close"): Client.IDLE,  # end the stale session; the next hello asks for a new one
    (Client.REPLAYING, "send_replay"): Client.REPLAY_SENT,
    (Client.REPLAY_SENT, "replay_result"): Client.REPLAYING,
    (Client.REPLAYING, "replayed"): Client.READY,  # nothing (left) to re-send
    (Client.READY, "send_block"): Client.BLOCK_SENT,
    (Client.BLOCK_SENT, "block_result"): Client.PENDING,
    (Client.PENDING, "commit"): Client.READY,
    (Client.READY, "uncommit"): Client.READY,  # rows still in the keep list leave it
    **{(state, "lost"): Client.IDLE for state in _AWAITING},  # session or connection gone: reconnect
    **{(state, "close"): Client.CLOSED for state in Client},
    (Server.AWAIT_HELLO, "hello"): Server.OPEN,
    (Server.AWAIT_HELLO, "probe"): Server.AWAIT_HELLO,  # path measurement needs no session
    (Server.AWAIT_HELLO, "close"): Server.CLOSED,
    (Server.OPEN, "hello"): Server.OPEN,  # another hello opens or resumes another session
    (Server.OPEN, "step"): Server.OPEN,  # guarded by check_step
    (Server.OPEN, "probe"): Server.OPEN,
    (Server.OPEN, "close"): Server.CLOSED,
}

_REFUSALS = {
    (Server.AWAIT_HELLO, "step"): "send hello before the first step.",
}


def transition(state: Client | Server, event: str) -> Client | Server:
    """The state after `event`; ProtocolError when the table does not allow it."""
    after = TRANSITIONS.get((state, event))
    if after is None:
        raise ProtocolError(_REFUSALS.get((state, event), f"{event} is not allowed while the link is {state.value}."))
    return after


# -- client ---------------------------------------------------------------------------------------------


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


class ClientLink:
    """The client's side of one cloud session. See the module docstring for what it decides."""

    def __init__(self, wire_dtype: str = "float16", max_retries: int = 5, replay_rows: int = 512):
        self.wire_dtype = wire_dtype
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

    def _move(self, event: str) -> None:
        self.state = transition(self.state, event)

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
            return self._step(positions, BlockStructure.chain(), rows)
        if self.state is Client.REPLAYING:
            self._move("replayed")
        self._move("send_block")
        block = self._block
        assert block is not None, "submit a block first"
        return self._step(block.positions, block.structure, block.hidden)

    def _step(self, positions: tuple[int, ...], structure: BlockStructure, hidden: torch.Tensor) -> Step:
        self._sent = Step(self.seq, self.keep, positions, structure, hidden, self.wire_dtype)
        return self._sent

    def on_welcome(self, welcome: Welcome) -> None:
        """The server answered the hello: carry on, end a stale session, or rebuild a fresh one."""
        cloud_committed = self.committed - len(self.keep)  # the keep list's rows are still pending there
        self.welcome = welcome
        if welcome.resumed and welcome.committed == cloud_committed and welcome.next_seq == self.seq:
            self._move("welcome_in_step")
            return
        if welcome.resumed:  # the server ran a step whose reply never came back: its state is not ours
            self._move("welcome_stale")
            return
        self._move("welcome_fresh")
        self.session_id, self.seq, self.keep = welcome.session_id, welcome.next_seq, ()
        self._replay = torch.cat(self._history) if self._history else None
        self._replay_at = 0

    def on_result(self, result: Result) -> Answered | Replayed:
        """The reply to the step in flight. Raises ProtocolError when it does not answer that step, or when
        the server's committed rows are not this client's (an untrusted server must agree)."""
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
        self.seq += 1
        self._sent, self._pending, self._block, self._attempts = None, self._block.hidden, None, 0
        return Answered(result)

    def _replay_answered(self, sent: Step) -> Replayed:
        self._move("replay_result")
        rows = sent.hidden.shape[0]
        self.seq += 1
        self.keep = tuple(range(rows))
        self._replay_at += rows
        self._sent = None
        done = self._replay_at >= self._replay.shape[0]
        if done:  # a compacted history is one tensor from now on
            self._history, self._replay = [self._replay], None
            self._move("replayed")
        return Replayed(rows, done)

    def lost(self) -> int | None:
        """The session or the connection was lost: the 0-based reconnect attempt (for the backoff), or
        None when `max_retries` reconnects were spent on this block and the loss should be raised."""
        self._move("lost")
        self._sent = None
        if self._replay is not None:  # a partly rebuilt session is useless; the next one starts over
            self._replay, self._replay_at = None, 0
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
        self.committed += len(rows)
        self._pending = None

    def uncommit(self, rows: int) -> bool:
        """Forget the last `rows` committed rows if the cloud has not committed them yet (they are all in
        the keep list); False otherwise. Shortening the keep list drops them there with no round trip."""
        if rows <= 0:
            return True
        if rows > len(self.keep) or not self._history:
            return False
        self._move("uncommit")
        self.keep = self.keep[: len(self.keep) - rows]
        self.committed -= rows
        self._history[-1] = self._history[-1][: self._history[-1].shape[0] - rows]
        return True

    def close(self) -> None:
        self._move("close")


# -- server ---------------------------------------------------------------------------------------------

_KINDS = {Hello: "hello", Step: "step", Probe: "probe", Close: "close"}


class ServerLink:
    """One connection's protocol state on the server: hello first, then steps, until close."""

    def __init__(self) -> None:
        self.state = Server.AWAIT_HELLO

    def check(self, message: Hello | Step | Probe | Close) -> Server:
        """The state after `message`, without moving there: ProtocolError when it is out of turn. The
        server moves (`state = ...`) once it has acted on the message, so a refused hello opens nothing."""
        return transition(self.state, _KINDS[type(message)])


def check_resume(hello: Hello, wire_dtype: str, head_layers: int, asked_head_layers: int) -> None:
    """A resumed session keeps the dtype and the head depth it was opened with."""
    if wire_dtype != hello.wire_dtype:
        raise ProtocolError("a session cannot change its wire dtype on resume; open a new session.")
    if head_layers != asked_head_layers:
        raise ProtocolError(
            f"a session cannot change its head depth on resume ({head_layers} -> {asked_head_layers}); "
            "open a new session."
        )


def check_step(
    step: Step,
    next_seq: int,
    wire_dtype: str,
    committed: int,
    pending_rows: int,
    pending_positions: tuple[int, ...],
    max_position: int,
) -> int:
    """A step against its session: seq, dtype, keep list, positions. Returns the committed rows once the
    keep list is applied. committed: rows the session holds; pending_rows and pending_positions: the
    previous block's rows still in its cache and their positions."""
    if step.seq != next_seq:
        raise ProtocolError(f"step seq {step.seq} is out of order; the session expects {next_seq}.")
    if step.wire_dtype != wire_dtype:
        raise ProtocolError(f"step tensor is {step.wire_dtype}, but the session uses {wire_dtype}.")
    if any(r >= pending_rows for r in step.keep):
        raise ProtocolError(f"keep names rows beyond the previous block of {pending_rows} rows.")
    for j, row in enumerate(step.keep):
        if pending_positions[row] != committed + j:
            raise ProtocolError("kept rows must form a contiguous path that continues the committed sequence.")
    committed += len(step.keep)
    q = len(step.positions)
    depths = step.structure.depths(q)
    if depths is not None:
        if list(step.positions) != [committed + d for d in depths]:
            raise ProtocolError(f"block positions must be the committed length ({committed}) plus each row's depth.")
    elif not all(committed <= p < committed + q for p in step.positions):
        raise ProtocolError(f"matrix block positions must lie in [{committed}, {committed + q}).")
    if max(step.positions) >= max_position:
        raise ProtocolError(f"position {max(step.positions)} exceeds the model's context of {max_position} tokens.")
    return committed
