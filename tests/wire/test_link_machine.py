"""The link's transitions fuzzed as state machines (hypothesis), as h11 and websockets fuzz theirs.

The server's connection (serverlink.ServerLink) is driven by any sequence of messages against a model of
what it must do; the shared table (link.TRANSITIONS) is walked by any sequence of events, and every step
is checked against the table's promises: close always ends the link, a closed link refuses all but
close, and a loss can only show while a reply is awaited.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from splitinfer.errors import CapacityError, ProtocolError
from splitinfer.masks import BlockStructure
from splitinfer.wire.link import AWAITING, TRANSITIONS, Client, Server, transition
from splitinfer.wire.messages import Close, Hello, Probe, Step
from splitinfer.wire.serverlink import ServerLink

HELLO = Hello("f" * 64, (2, 5), "float32")
STEP = Step(0, (), (0,), BlockStructure.chain(), torch.zeros(1, 4), "float32")
MAX_ERRORS = 3


class ServerLinkMachine(RuleBasedStateMachine):
    """What cloud/server.py does with one connection: check each message, act, then move, or refuse it."""

    def __init__(self):
        super().__init__()
        self.link = ServerLink(MAX_ERRORS)
        self.opened: str | None = None  # the model: the session open on the connection
        self.closed = False
        self.errors = 0
        self.hellos = 0

    def deliver(self, message, session_id=None) -> bool:
        try:
            self.link.check(message)
        except ProtocolError as exc:
            self.errors += 1
            assert self.link.refused(exc) == (self.errors >= MAX_ERRORS)
            return False
        self.link.moved(message, session_id)
        return True

    @rule()
    def hello(self):
        self.hellos += 1
        assert self.deliver(HELLO, f"s{self.hellos}") == (not self.closed)
        if not self.closed:
            self.opened = f"s{self.hellos}"

    @rule()
    def hello_the_table_refuses(self):
        # The session table refuses (capacity) after the link allowed the hello: the link does not move,
        # and the refusal is not the peer's protocol error.
        if not self.closed:
            self.link.check(HELLO)
        assert self.link.refused(CapacityError("full")) == (self.errors >= MAX_ERRORS)

    @rule()
    def step(self):
        assert self.deliver(STEP) == (self.opened is not None and not self.closed)

    @rule()
    def probe(self):
        assert self.deliver(Probe(1, 0)) == (not self.closed)

    @rule()
    def close(self):
        assert self.deliver(Close()) == (not self.closed)
        self.closed, self.opened = True, None

    @invariant()
    def the_link_matches_the_model(self):
        expected = Server.CLOSED if self.closed else Server.OPEN if self.opened else Server.AWAIT_HELLO
        assert self.link.state is expected
        assert self.link.session_id == self.opened
        assert self.link.errors == self.errors


EVENTS = sorted({event for _, event in TRANSITIONS})
STATES = [*Client, *Server]


class TableMachine(RuleBasedStateMachine):
    """Any event in any state: the table's answer, and the promises it keeps."""

    def __init__(self):
        super().__init__()
        self.state: Client | Server = Client.IDLE

    @rule(start=st.sampled_from(STATES))
    def jump(self, start):
        self.state = start  # every state, not only those a well-behaved peer reaches

    @rule(event=st.sampled_from(EVENTS))
    def fire(self, event):
        before = self.state
        try:
            after = transition(before, event)
        except ProtocolError as exc:
            assert (before, event) not in TRANSITIONS and str(exc)
            return
        assert after is TRANSITIONS[(before, event)] and type(after) is type(before)
        if event == "close":
            assert after in (Client.CLOSED, Server.CLOSED)
        if event == "lost":
            assert before in AWAITING and after is Client.IDLE
        if before in (Client.CLOSED, Server.CLOSED):
            assert event == "close" and before is Client.CLOSED, "a closed link refuses all but close"
        self.state = after

    @invariant()
    def close_is_always_allowed_on_the_client(self):
        if isinstance(self.state, Client):
            assert transition(self.state, "close") is Client.CLOSED


TestServerLink = ServerLinkMachine.TestCase
TestServerLink.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
TestTable = TableMachine.TestCase
TestTable.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


def test_the_machines_would_catch_a_server_that_lets_a_step_in_before_hello(monkeypatch):
    from splitinfer.wire import link

    monkeypatch.setitem(link.TRANSITIONS, (Server.AWAIT_HELLO, "step"), Server.AWAIT_HELLO)
    with pytest.raises(AssertionError):
        machine = ServerLinkMachine()
        machine.step()
