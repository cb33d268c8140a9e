"""The link protocol at both ends, sans-I/O: which message goes next, and which ones a peer may send.

Client (`ClientLink`): one conversation's cloud session as the client sees it. It decides the hello
(a new session, or resume the last one), judges the welcome against what the client committed, numbers
the steps (seq), carries the lazy-commit keep list, re-sends the committed history into a fresh session
after a loss, and checks that every result answers the step it was sent for. With blocks in flight
(protocol v3, `submit_ahead`) it sends steps before the earlier ones are answered, names the earlier
unresolved blocks each one assumes accepted, resolves them oldest first and drops the ones whose
assumption failed; a loss with blocks in flight rebuilds the session from the committed history. A driver
(local/session.py) asks `next_send()` what to send, sends it, and feeds the reply back; the link never
touches a socket, runs no model and never sleeps, so every rule here is testable with plain tensors.

Server (`ServerLink`, `check_resume`, `check_step`, `dropped`): the rules a server applies to what a peer
sends: hello before any step, a resume that keeps the session's dtype and head depth, steps in seq order,
keep lists that name a contiguous path continuing the committed sequence, positions that follow from the
block's structure, and (v3) assumptions that name the blocks in flight in order, each of them still valid;
and which received step need not run, because a later one already says the client dropped it.
cloud/server.py and cloud/sessions.py call them; they hold the state (sessions,
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
from .messages import PIPELINE_VERSION, Assumed, Close, Hello, Probe, Result, Step, Welcome


class Client(Enum):
    IDLE = "idle"  # no session on the current connection: at the start, and after a loss
    OPENING = "opening"  # hello sent, welcome awaited
    STALE = "stale"  # the resumed session is out of step with this client; it is ended before a fresh one
    REPLAYING = "replaying"  # a fresh session: the committed history is re-sent before anything else
    REPLAY_SENT = "replay_sent"  # one chunk of history sent, its result awaited
    READY = "ready"  # the cloud holds exactly what this client committed; a block may go
    BLOCK_SENT = "block_sent"  # the block's step sent, its result awaited
    PENDING = "pending"  # the block came back; it waits for the rows to commit
    FLYING = "flying"  # blocks in flight (v3): steps sent before the earlier ones were answered
    CLOSED = "closed"


class Server(Enum):
    AWAIT_HELLO = "await_hello"  # a new connection: only hello, probe or close
    OPEN = "open"  # a session is open on this connection
    CLOSED = "closed"


# a reply is due: only here can a loss show
_AWAITING = (Client.OPENING, Client.REPLAY_SENT, Client.BLOCK_SENT, Client.FLYING)

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
    (Client.IDLE, "uncommit"): Client.IDLE,  # after a loss too: the resume or the rebuild then lacks them
    (Client.READY, "send_ahead"): Client.FLYING,  # a block that may assume earlier unresolved ones
    (Client.FLYING, "send_ahead"): Client.FLYING,
    (Client.FLYING, "ahead_result"): Client.FLYING,  # more steps are still in flight
    (Client.FLYING, "landed"): Client.READY,  # the last step in flight was answered
    (Client.FLYING, "resolve"): Client.FLYING,  # the oldest answered block's kept rows are known
    (Client.READY, "resolve"): Client.READY,
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


@dataclass(eq=False)
class _Flight:
    """A block sent ahead (v3): its head outputs, and what its reply must report."""

    seq: int
    hidden: torch.Tensor  # [q, d] head outputs
    committed: int  # the cloud's committed rows once this step's keep list is applied
    wanted: bool = True  # False once dropped: its reply, when it comes, is discarded
    answered: bool = False


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
        self.version: int | None = None  # the hello's version: PIPELINE_VERSION to ask for blocks in flight
        self.max_in_flight = 1  # blocks this session may have in flight at once (the welcome's; 1 before v3)
        self._assume: tuple[tuple[int, ...], ...] | None = None  # the submitted block's assumed rows, per live block
        self._flight: list[_Flight] = []  # steps sent ahead and not answered yet, oldest first
        self._live: list[_Flight] = []  # blocks sent ahead, neither resolved nor dropped, oldest first
        self._to_resolve = False  # the cloud's oldest pending block is resolved here; the next step says so
        self._also: list[Assumed] = []  # blocks resolved here after that one, in order: the next step commits them too
        self._rebuild = False  # blocks in flight were lost: open a fresh session rather than resume

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
        if self._assume is not None:
            return self._send_ahead()
        self._move("send_block")
        block = self._block
        assert block is not None, "submit a block first"
        return self._step(block.positions, block.structure, block.hidden)

    def _step(self, positions: tuple[int, ...], structure: BlockStructure, hidden: torch.Tensor) -> Step:
        also = tuple(self._also)  # left by blocks in flight: committed by this step too
        self._sent = Step(self.seq, self.keep, positions, structure, hidden, self.wire_dtype, also, len(also))
        return self._sent

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

    def lost(self) -> int | None:
        """The session or the connection was lost: the 0-based reconnect attempt (for the backoff), or
        None when `max_retries` reconnects were spent on this block and the loss should be raised."""
        if self.state is Client.FLYING:  # which of the steps in flight the server ran is unknown: rebuild
            self._rebuild = True
            self._flight, self._live, self._assume, self._block = [], [], None, None
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
                    len(self._also))
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


@dataclass(frozen=True)
class PendingBlock:
    """A block the cloud ran whose rows the client has not resolved yet."""

    seq: int
    positions: tuple[int, ...]
    assume: tuple[Assumed, ...] = ()  # the earlier pending blocks it ran assuming accepted (v3)


@dataclass(frozen=True)
class StepPlan:
    """What a valid step does to its session, oldest pending block first."""

    resolves: tuple[tuple[int, ...], ...]  # rows to commit of each of the oldest pending blocks, in order
    pending: tuple[PendingBlock, ...]  # the pending blocks the step builds on; every other one is dropped
    committed: int  # committed rows once `resolves` are applied


def check_step(
    step: Step,
    next_seq: int,
    wire_dtype: str,
    committed: int,
    pending: tuple[PendingBlock, ...],
    max_position: int,
    max_in_flight: int = 1,
) -> StepPlan:
    """A step against its session: seq, dtype, keep list, assumptions, positions. committed: rows the
    session holds; pending: the blocks it ran that are not resolved, oldest first; max_in_flight: blocks
    that may be pending at once, the step's own included (1 before v3).

    A step resolves the oldest pending block with its keep list, unless it assumes that block (then its keep
    list is empty), and then the next `resolved` ones with their rows in `assume`; it builds on the pending
    blocks it assumes after those, which must be the next ones in order, each still valid (run under the
    same assumptions), and drops every later one.
    """
    if step.seq != next_seq:
        raise ProtocolError(f"step seq {step.seq} is out of order; the session expects {next_seq}.")
    if step.wire_dtype != wire_dtype:
        raise ProtocolError(f"step tensor is {step.wire_dtype}, but the session uses {wire_dtype}.")
    if len(step.assume) - step.resolved >= max_in_flight:
        raise ProtocolError(
            f"this session allows {max_in_flight} block(s) in flight, so a step may assume at most "
            f"{max_in_flight - 1} earlier one(s); send fewer ahead (a v3 hello asks for blocks in flight)."
        )
    rest: list[PendingBlock | None] = list(pending)
    resolves: list[tuple[int, ...]] = []
    if step.assume and rest and step.assume[0].seq == rest[0].seq and not step.resolved:
        if step.keep:
            raise ProtocolError(f"a step that assumes block {rest[0].seq} cannot also keep rows of it.")
    else:
        oldest = rest.pop(0) if rest else None
        _check_path(step.keep, oldest.positions if oldest else (), committed, "keep")
        committed += len(step.keep)
        resolves.append(step.keep)
        rest = [_after_resolution(block, oldest.seq, step.keep) for block in rest] if oldest else rest
    for settled in step.assume[: step.resolved]:
        block = rest.pop(0) if rest else None
        if block is None or block.seq != settled.seq or block.assume:
            raise ProtocolError(f"the step resolves block {settled.seq}, which is not the next valid block in flight.")
        _check_path(settled.rows, block.positions, committed, "assume")
        committed += len(settled.rows)
        resolves.append(settled.rows)
        rest = [_after_resolution(later, block.seq, settled.rows) for later in rest]
    kept = _check_assumptions(step, step.assume[step.resolved :], rest, committed, max_position)
    return StepPlan(tuple(resolves), kept, committed)


def dropped(step: Step, later: list[Step]) -> bool:
    """Whether steps of the same session received after `step` (in order) say the client dropped it, so it
    need not run: one of them names neither it nor anything after it.

    A client builds on a block it sent ahead by naming it in `assume`, and commits it by naming it there too
    (`resolved`) or with the keep list of the step after its reply; a step sent before `step` was answered
    cannot do the latter. So a later step that does not name `step` was sent after the client dropped it, and
    its reply would be discarded. Whatever a peer sends here, skipping a step only spares its pass: its keep
    list and resolutions still apply and the steps after it are checked as ever (check_step).
    """
    return any(l.seq > step.seq and all(a.seq != step.seq for a in l.assume) for l in later)


def _after_resolution(block: PendingBlock | None, seq: int, kept: tuple[int, ...]) -> PendingBlock | None:
    """`block` once pending block `seq` kept `kept`: its assumption about it settled, or None when it failed."""
    if block is None or not block.assume or block.assume[0] != Assumed(seq, tuple(kept)):
        return None
    return PendingBlock(block.seq, block.positions, block.assume[1:])


def _check_assumptions(step: Step, assume, rest: list[PendingBlock | None], committed: int, max_position: int):
    live = [b.seq for b in rest if b is not None]
    named = [a.seq for a in assume]
    if named != [b.seq if b is not None else None for b in rest[: len(named)]]:
        raise ProtocolError(
            f"the step assumes blocks {named}, but the valid blocks in flight on this session are {live}; "
            "assume them oldest first, and never a block whose own assumption failed."
        )
    base = committed
    for i, (assumed, block) in enumerate(zip(assume, rest)):
        if block.assume != assume[:i]:
            raise ProtocolError(
                f"block {block.seq} ran assuming other rows of the blocks before it than this step assumes; "
                "its assumption fails under this step's, so do not build on it."
            )
        _check_path(assumed.rows, block.positions, base, "assume")
        base += len(assumed.rows)
    q = len(step.positions)
    depths = step.structure.depths(q)
    if depths is not None:
        if list(step.positions) != [base + d for d in depths]:
            raise ProtocolError(f"block positions must be the committed length ({base}) plus each row's depth.")
    elif not all(base <= p < base + q for p in step.positions):
        raise ProtocolError(f"matrix block positions must lie in [{base}, {base + q}).")
    if max(step.positions) >= max_position:
        raise ProtocolError(f"position {max(step.positions)} exceeds the model's context of {max_position} tokens.")
    return tuple(rest[: len(assume)])


def _check_path(rows: tuple[int, ...], positions: tuple[int, ...], committed: int, name: str) -> None:
    """`rows` of a pending block at `positions` form a contiguous path continuing `committed` rows."""
    if any(r >= len(positions) for r in rows):
        what = "the previous block" if name == "keep" else "the assumed block"
        raise ProtocolError(f"{name} names rows beyond {what} of {len(positions)} rows.")
    for j, row in enumerate(rows):
        if positions[row] != committed + j:
            raise ProtocolError(f"{name}: kept rows must form a contiguous path that continues the committed sequence.")
