"""The server's end of the link, sans-I/O: one connection's protocol state (`ServerLink`), and the rules a
server applies to what a peer sends (`check_resume`, `check_step`, `dropped`).

The rules: hello before any step, a resume that keeps the session's dtype and head depth, steps in seq
order, keep lists that name a contiguous path continuing the committed sequence, positions that follow
from the block's structure, and (v3) assumptions that name the blocks in flight in order, each of them
still valid; and which received step need not run, because a later one already says the client dropped
it. cloud/server.py keeps a ServerLink per connection and cloud/sessions.py applies the step rules; they
hold the state that outlives a connection (sessions, caches), this module the rules. The state table both
ends share is link.py's; the client's end is clientlink.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ProtocolError
from .link import Server, transition
from .messages import Assumed, Close, Hello, Probe, Step

_KINDS = {Hello: "hello", Step: "step", Probe: "probe", Close: "close"}


class ServerLink:
    """One connection's protocol state on the server, next to the client's ClientLink: where the link is in
    the table (hello first, then steps, until close), the session open on it, and the protocol errors its
    peer has made. The server asks `check` before acting on a message and calls `moved` after, so a refused
    hello opens nothing; `refused` counts an error and says when to close the connection."""

    def __init__(self, max_errors: int) -> None:
        self.state = Server.AWAIT_HELLO
        self.session_id: str | None = None  # the session the last hello opened or resumed
        self.errors = 0  # protocol errors so far (capacity or expiry is not the peer's fault)
        self.max_errors = max_errors  # close the connection at this many

    def check(self, message: Hello | Step | Probe | Close) -> Server:
        """The state after `message`, without moving there: ProtocolError when it is out of turn."""
        return transition(self.state, _KINDS[type(message)])

    def moved(self, message: Hello | Step | Probe | Close, session_id: str | None = None) -> None:
        """The server acted on `message`: move on; a hello's session (`session_id`) is now the open one, a
        close leaves none."""
        self.state = self.check(message)
        if isinstance(message, Hello):
            self.session_id = session_id
        elif isinstance(message, Close):
            self.session_id = None

    def refused(self, error: Exception) -> bool:
        """The server refused a message with `error`: True when the peer has now made too many protocol
        errors and the connection should be closed."""
        self.errors += isinstance(error, ProtocolError)
        return self.errors >= self.max_errors


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
    skip: bool = False,
) -> StepPlan:
    """A step against its session: seq, dtype, keep list, assumptions, positions. committed: rows the
    session holds; pending: the blocks it ran that are not resolved, oldest first; max_in_flight: blocks
    that may be pending at once, the step's own included (1 before v3); skip: the step will not run
    (`dropped`), so only its seq, keep list and resolutions are checked.

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
    if skip:
        return StepPlan(tuple(resolves), _still_valid(step.assume[step.resolved :], rest, committed), committed)
    kept = _check_assumptions(step, step.assume[step.resolved :], rest, committed, max_position)
    return StepPlan(tuple(resolves), kept, committed)


def dropped(step: Step, later: list[Step]) -> bool:
    """Whether steps of the same session received after `step` (in order) say the client dropped it, so it
    need not run: one of them names neither it nor anything after it.

    A client builds on a block it sent ahead by naming it in `assume`, and commits it by naming it there too
    (`resolved`) or with the keep list of the step after its reply; a step sent before `step` was answered
    cannot do the latter. So a later step that does not name `step` was sent after the client dropped it, and
    its reply would be discarded. Whatever a peer sends here, skipping a step only spares its pass: its keep
    list and resolutions still apply, and the steps after it are checked as ever (check_step with `skip`: the
    blocks it assumes may include one skipped before it, since a client drops every block built on a dropped one).
    """
    return any(l.seq > step.seq and all(a.seq != step.seq for a in l.assume) for l in later)


def _after_resolution(block: PendingBlock | None, seq: int, kept: tuple[int, ...]) -> PendingBlock | None:
    """`block` once pending block `seq` kept `kept`: its assumption about it settled, or None when it failed."""
    if block is None or not block.assume or block.assume[0] != Assumed(seq, tuple(kept)):
        return None
    return PendingBlock(block.seq, block.positions, block.assume[1:])


def _still_valid(assume: tuple[Assumed, ...], rest: list[PendingBlock | None], committed: int):
    """The pending blocks a skipped step keeps: those it assumes, up to the first that is not the next valid
    one. Its assumptions may name a block skipped before it (a client drops every block built on a dropped one,
    and the step that shows it drops this one too); whatever they name, a later step is checked as ever."""
    kept: list[PendingBlock] = []
    for i, (assumed, block) in enumerate(zip(assume, rest)):
        if block is None or block.seq != assumed.seq or block.assume != assume[:i]:
            break
        try:
            _check_path(assumed.rows, block.positions, committed, "assume")
        except ProtocolError:
            break
        committed += len(assumed.rows)
        kept.append(block)
    return tuple(kept)


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
