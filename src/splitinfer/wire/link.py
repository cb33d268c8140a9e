"""The link protocol's one state table, sans-I/O.

`TRANSITIONS` holds both ends' transitions; an event it does not list for the current state is refused
with ProtocolError (`transition`). Each end has its connection object over it: the client's `ClientLink`
(clientlink.py) and the server's `ServerLink` with the rules a server applies to a peer (serverlink.py).
"""

from __future__ import annotations

from enum import Enum

from ..errors import ProtocolError


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


# The WebSocket close code of a server that is draining (SIGTERM): it finished the step in progress and is
# going away, so the client opens its session elsewhere at once, without backoff (errors.Draining). In the
# 4000-4999 range that RFC 6455 leaves to applications.
DRAINING_CLOSE = 4001
# WebSocket keepalive, the same on both ends: a ping every PING_INTERVAL_S, the link dropped when none is
# answered within PING_TIMEOUT_S (a long pass on a loaded server must not look like a dead peer).
PING_INTERVAL_S = 20
PING_TIMEOUT_S = 60

# a reply is due: only here can a loss show
AWAITING = (Client.OPENING, Client.REPLAY_SENT, Client.BLOCK_SENT, Client.FLYING)

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
    **{(state, "lost"): Client.IDLE for state in AWAITING},  # session or connection gone: reconnect
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
