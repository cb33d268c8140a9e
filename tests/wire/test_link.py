"""The link protocol with no socket and no model: every client transition (clientlink.py), the server's
connection and rules (serverlink.py)."""

from __future__ import annotations

import pytest
import torch

from splitinfer.errors import ProtocolError
from splitinfer.masks import BlockStructure
from splitinfer.wire import link as link_module
from splitinfer.wire.clientlink import Answered, Block, ClientLink, Open, Replayed
from splitinfer.wire.link import TRANSITIONS, Client, Server
from splitinfer.wire.serverlink import PendingBlock, ServerLink, check_resume, check_step, dropped
from splitinfer.wire.messages import (
    PIPELINE_VERSION, Assumed, Close, Hello, Limits, Probe, Result, Step, Welcome, decode_client_message,
    decode_server_message,
)

D = 4
LIMIT = 1 << 20


def welcome(session_id="s1", committed=0, resumed=False, next_seq=0, max_block_rows=1024, max_message_bytes=1 << 24):
    return Welcome(session_id, committed, resumed, max_message_bytes, max_block_rows, next_seq)


def block(start: int, q: int) -> Block:
    hidden = torch.arange(start * D, (start + q) * D, dtype=torch.float32).reshape(q, D)  # [q, d], row i = position i
    structure = BlockStructure.chain() if q == 1 else BlockStructure.tree(list(range(-1, q - 1)))
    return Block(tuple(range(start, start + q)), structure, hidden)


def answer(step: Step, committed: int, rows: int | None = None, seq: int | None = None) -> Result:
    q = step.hidden.shape[0] if rows is None else rows
    return Result(step.seq if seq is None else seq, torch.zeros(q, D), 1.0, 2.0, committed, "float32")


def send_block(link: ClientLink, start: int, q: int) -> Step:
    """Submit a block and return its step, opening the session if needed (a fresh one: nothing to replay)."""
    link.submit(block(start, q))
    message = link.next_send()
    if isinstance(message, Open):
        link.on_welcome(welcome())
        message = link.next_send()
    assert isinstance(message, Step)
    return message


def run(link: ClientLink, start: int, q: int, keep: int) -> Step:
    """One block through the cloud, then commit its first `keep` rows."""
    step = send_block(link, start, q)
    assert isinstance(link.on_result(answer(step, link.committed)), Answered)
    link.commit(list(range(keep)))
    return step


def linked(committed_blocks=((0, 5, 5), (5, 3, 2))) -> ClientLink:
    """A link in step with its cloud after a 5-row prefill and a 3-row block of which 2 rows were kept."""
    link = ClientLink("float32", max_retries=3, replay_rows=4)
    for start, q, keep in committed_blocks:
        run(link, start, q, keep)
    return link


# -- the client ------------------------------------------------------------------------------------------


def test_a_new_session_numbers_steps_and_carries_the_keep_list():
    link = ClientLink("float32")
    link.submit(block(0, 5))
    assert link.next_send() == Open(None) and link.state is Client.OPENING
    link.on_welcome(welcome(next_seq=7))
    assert link.state is Client.REPLAYING and link.session_id == "s1"
    first = link.next_send()  # nothing to re-send: the block goes at once
    assert link.state is Client.BLOCK_SENT
    assert (first.seq, first.keep, first.positions, first.wire_dtype) == (7, (), (0, 1, 2, 3, 4), "float32")
    reply = link.on_result(answer(first, 0))
    assert isinstance(reply, Answered) and link.state is Client.PENDING
    link.commit([0, 1, 2, 3, 4])
    assert (link.state, link.committed, link.keep) == (Client.READY, 5, (0, 1, 2, 3, 4))
    second = send_block(link, 5, 3)
    assert (second.seq, second.keep, second.positions) == (8, (0, 1, 2, 3, 4), (5, 6, 7))


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(seq=9), "does not answer"),
        (dict(rows=2), "returned 2 rows for a 3-row block"),
        (dict(committed=4), "reports 4 committed rows where this client has 5"),
    ],
)
def test_a_result_that_does_not_fit_is_refused(bad, match):
    link = linked(((0, 5, 5),))
    step = send_block(link, 5, 3)
    committed = bad.pop("committed", 5)
    with pytest.raises(ProtocolError, match=match):
        link.on_result(answer(step, committed, **bad))


def test_a_lost_connection_resumes_the_session_in_step():
    link = linked()
    step = send_block(link, 7, 1)
    assert link.lost() == 0 and link.state is Client.IDLE  # the step's reply never came
    assert link.next_send() == Open("s1")
    link.on_welcome(welcome(committed=5, resumed=True, next_seq=2))  # the server never ran the lost step
    assert link.state is Client.READY
    again = link.next_send()
    assert (again.seq, again.keep, again.positions) == (step.seq, step.keep, step.positions) == (2, (0, 1), (7,))
    assert isinstance(link.on_result(answer(again, 7)), Answered)


@pytest.mark.parametrize("cloud", [dict(committed=7, next_seq=3), dict(committed=5, next_seq=3), dict(committed=0, next_seq=2)])
def test_a_resumed_session_out_of_step_is_ended_and_rebuilt(cloud):
    """The server ran a step whose reply was lost (seq and committed rows moved on), or holds other rows:
    the client ends that session, opens a fresh one and re-sends every committed row before the block."""
    link = linked()
    step = send_block(link, 7, 1)
    link.lost()
    assert link.next_send() == Open("s1")
    link.on_welcome(welcome(resumed=True, **cloud))
    assert link.state is Client.STALE
    assert link.next_send() == Close() and link.session_id is None and link.state is Client.IDLE
    assert link.next_send() == Open(None)
    link.on_welcome(welcome(session_id="s2", next_seq=0))
    sent = replay(link)
    assert [s.positions for s in sent] == [(0, 1, 2, 3), (4, 5, 6)]  # replay_rows=4
    assert [(s.seq, s.keep) for s in sent] == [(0, ()), (1, (0, 1, 2, 3))]
    assert torch.equal(torch.cat([s.hidden for s in sent]), block(0, 7).hidden)  # the rows kept, in order
    again = link.next_send()
    assert (again.seq, again.keep, again.positions) == (2, (0, 1, 2), step.positions)
    assert torch.equal(again.hidden, step.hidden)
    assert isinstance(link.on_result(answer(again, 7)), Answered) and link.session_id == "s2"


def replay(link: ClientLink) -> list[Step]:
    """Answer every history chunk the link re-sends; returns their steps."""
    sent = []
    while True:
        step = link.next_send()
        assert link.state is Client.REPLAY_SENT
        sent.append(step)
        reply = link.on_result(answer(step, 0))
        assert isinstance(reply, Replayed) and reply.rows == step.hidden.shape[0]
        if reply.done:
            assert link.state is Client.READY
            return sent
        assert link.state is Client.REPLAYING


def test_an_expired_session_is_rebuilt_in_chunks_the_server_allows():
    link = linked()
    send_block(link, 7, 1)
    link.lost()
    link.next_send()
    link.on_welcome(welcome(session_id="s2", next_seq=0, max_block_rows=3))  # the server forgot it
    assert link.state is Client.REPLAYING
    assert [s.positions for s in replay(link)] == [(0, 1, 2), (3, 4, 5), (6,)]


def test_a_loss_during_replay_starts_the_rebuild_over():
    link = linked()
    send_block(link, 7, 1)
    link.lost()
    link.next_send()
    link.on_welcome(welcome(session_id="s2"))
    first = link.next_send()
    link.on_result(answer(first, 0))
    link.next_send()  # the second chunk is lost on the way
    assert link.lost() == 1 and link.state is Client.IDLE
    assert link.next_send() == Open("s2")
    link.on_welcome(welcome(session_id="s2", committed=0, resumed=True, next_seq=2))  # first chunk still pending
    assert link.state is Client.STALE  # half a history is not this client's state
    link.next_send()
    link.next_send()
    link.on_welcome(welcome(session_id="s3"))
    assert [s.positions for s in replay(link)] == [(0, 1, 2, 3), (4, 5, 6)]


def test_retries_are_counted_per_block_and_run_out():
    link = linked()
    link.submit(block(7, 1))
    link.next_send()
    attempts = [link.lost()]
    for _ in range(3):
        assert link.next_send() == Open("s1")  # each reconnect is another hello
        attempts.append(link.lost())
    assert attempts == [0, 1, 2, None]  # max_retries=3 reconnects spent: the caller raises
    link.submit(block(7, 1))  # the block was given up; a new one may go, with a fresh count
    assert link.next_send() == Open("s1")
    assert link.lost() == 0
    link.next_send()
    link.on_welcome(welcome(committed=5, resumed=True, next_seq=2))
    link.on_result(answer(link.next_send(), 7))
    link.commit([0])
    link.submit(block(8, 1))
    link.next_send()
    assert link.lost() == 0  # an answered block resets the count


def test_uncommit_shortens_the_keep_list_and_the_history():
    link = linked()
    assert link.uncommit(0) is True and link.committed == 7
    assert link.uncommit(3) is False  # only 2 rows of the last block are not on the cloud yet
    assert link.uncommit(1) is True and (link.committed, link.keep) == (6, (0,))
    step = send_block(link, 6, 1)
    assert step.keep == (0,) and step.positions == (6,)
    link.lost()  # the rebuilt session holds exactly the 6 rows left
    link.next_send()
    link.on_welcome(welcome(session_id="s2"))
    assert torch.equal(torch.cat([s.hidden for s in replay(link)]), block(0, 6).hidden)


def test_a_closed_link_refuses_everything_but_close():
    link = linked()
    link.close()
    assert link.state is Client.CLOSED
    link.close()
    with pytest.raises(ProtocolError, match="while the link is closed"):
        link.next_send()
    with pytest.raises(ProtocolError, match="lost is not allowed"):
        link.lost()


def test_out_of_turn_client_events_are_refused():
    link = linked()
    with pytest.raises(ProtocolError, match="commit is not allowed while the link is ready"):
        link.commit([0])
    with pytest.raises(ProtocolError, match="welcome_fresh is not allowed"):
        link.on_welcome(welcome())
    send_block(link, 7, 1)
    with pytest.raises(ProtocolError, match="uncommit is not allowed while the link is block_sent"):
        link.uncommit(1)


def test_max_rows_follows_the_welcome():
    link = ClientLink()
    assert link.max_rows(512, 256) == 512  # no welcome yet: what the client asked for
    link.next_send()
    link.on_welcome(welcome(max_block_rows=100, max_message_bytes=65536 + 256 * 10))
    assert link.max_rows(512, 256) == 10 and link.max_rows(5, 256) == 5 and link.max_rows(0, 256) == 1


# -- blocks in flight (v3) ---------------------------------------------------------------------------------


def pipelined(max_in_flight: int = 3) -> ClientLink:
    """A v3 link after a 5-row prefill, the prefill's rows resolved but not yet told to the cloud."""
    link = ClientLink("float32", max_retries=3, replay_rows=4)
    link.submit(block(0, 5))
    assert link.next_send() == Open(None)
    link.on_welcome(Welcome("s1", 0, False, 1 << 24, 1024, 0, PIPELINE_VERSION, max_in_flight))
    prefill = link.next_send()
    link.on_result(answer(prefill, 0))
    link.commit(list(range(5)))
    return link


def ahead(link: ClientLink, start: int, q: int, assume: list[tuple[int, ...]]) -> Step:
    link.submit_ahead(block(start, q), assume)
    message = link.next_send()
    assert isinstance(message, Step) and link.state is Client.FLYING
    return message


def test_blocks_in_flight_assume_the_live_blocks_and_resolve_oldest_first():
    link = pipelined()
    assert link.max_in_flight == 3
    a = ahead(link, 5, 3, [])  # nothing live: it resolves the prefill
    assert (a.seq, a.keep, a.assume, a.positions) == (1, (0, 1, 2, 3, 4), (), (5, 6, 7))
    b = ahead(link, 8, 2, [(0, 1, 2)])  # assumes a keeps its whole chain
    assert (b.seq, b.keep, b.assume, b.positions) == (2, (), (Assumed(1, (0, 1, 2)),), (8, 9))
    assert isinstance(link.on_result(answer(a, 5)), Answered) and link.state is Client.FLYING
    link.resolve([0, 1, 2])
    assert (link.committed, link.live, link.flying) == (8, 1, 1)
    c = ahead(link, 10, 1, [(0, 1)])
    assert (c.seq, c.keep, c.assume) == (3, (0, 1, 2), (Assumed(2, (0, 1)),))
    assert isinstance(link.on_result(answer(b, 5)), Answered)  # sent before a was resolved
    link.resolve([0])  # b kept less than c assumed: c is invalid
    link.drop_live()
    assert link.on_result(answer(c, 8)) is None and link.state is Client.READY  # its reply is discarded
    d = send_block(link, 9, 1)  # one block at a time again: it resolves b and drops c on the cloud
    assert (d.seq, d.keep, d.assume, d.positions) == (4, (0,), (), (9,))


def test_blocks_resolved_with_no_step_between_are_committed_by_the_next_step():
    link = pipelined()
    a = ahead(link, 5, 2, [])
    b = ahead(link, 7, 1, [(0, 1)])
    link.on_result(answer(a, 5))
    link.resolve([0, 1])
    link.on_result(answer(b, 5))
    link.resolve([0])  # nothing could be sent after a: the next step commits both
    assert link.uncommit(1) is False and link.committed == 8
    c = send_block(link, 8, 1)  # one block at a time from here
    assert (c.keep, c.assume, c.resolved) == ((0, 1), (Assumed(b.seq, (0,)),), 1)
    link.on_result(answer(c, 8))
    link.commit([0])
    assert send_block(link, 9, 1).assume == ()


def test_the_last_block_in_flight_lands_then_resolves():
    link = pipelined()
    a = ahead(link, 5, 2, [])
    assert isinstance(link.on_result(answer(a, 5)), Answered) and link.state is Client.READY
    link.resolve([0, 1])
    assert (link.committed, link.keep) == (7, (0, 1)) and link.uncommit(1) and link.keep == (0,)


def test_a_loss_with_blocks_in_flight_rebuilds_the_session():
    link = pipelined()
    a = ahead(link, 5, 3, [])
    ahead(link, 8, 1, [(0, 1, 2)])
    link.on_result(answer(a, 5))
    link.resolve([0, 1])
    assert link.lost() == 0 and (link.live, link.flying) == (0, 0)
    assert link.next_send() == Open("s1")
    link.on_welcome(Welcome("s1", 5, True, 1 << 24, 1024, 2, PIPELINE_VERSION, 3))  # in step, yet rebuilt
    assert link.state is Client.STALE and link.next_send() == Close()
    link.submit_ahead(block(7, 1), [])
    assert link.next_send() == Open(None)
    link.on_welcome(Welcome("s2", 0, False, 1 << 24, 1024, 0, PIPELINE_VERSION, 3))
    sent = replay(link)
    assert torch.equal(torch.cat([s.hidden for s in sent]), block(0, 7).hidden)
    again = link.next_send()
    assert (again.keep, again.assume, again.positions) == ((0, 1, 2), (), (7,)) and link.state is Client.FLYING


def test_rows_left_unemitted_can_be_forgotten_after_a_loss():
    link = pipelined()
    a = ahead(link, 5, 3, [])
    ahead(link, 8, 1, [(0, 1, 2)])
    link.on_result(answer(a, 5))
    link.resolve([0, 1, 2])
    link.lost()  # decoding ended inside a's path as the link went, with b still in flight
    assert link.uncommit(2) and (link.committed, link.keep) == (6, (0,))
    link.next_send()
    link.on_welcome(Welcome("s2", 0, False, 1 << 24, 1024, 0, PIPELINE_VERSION, 3))
    assert torch.equal(torch.cat([s.hidden for s in replay(link)]), block(0, 6).hidden)


def test_an_old_server_allows_one_block_in_flight():
    link = ClientLink("float32")
    link.submit(block(0, 2))
    link.next_send()
    link.on_welcome(Welcome("s1", 0, False, 1 << 24, 1024, 0, 2, 3))  # a v2 welcome: no blocks in flight
    assert link.max_in_flight == 1


def test_v3_fields_round_trip_and_stay_out_of_older_messages():
    limits = Limits(hidden_size=D)
    assumed = (Assumed(3, (0, 1)), Assumed(4, (0,)))
    message = Step(5, (), (9,), BlockStructure.chain(), torch.zeros(1, D), "float32", assumed)
    assert decode_client_message(message.encode(), limits).assume == assumed
    plain = Step(5, (0,), (9,), BlockStructure.chain(), torch.zeros(1, D), "float32")
    assert b"assume" not in plain.encode() and decode_client_message(plain.encode(), limits).assume == ()
    v3 = Welcome("s", 0, False, 1 << 20, 64, 0, PIPELINE_VERSION, 3)
    assert decode_server_message(v3.encode(), limits).max_in_flight == 3
    assert b"max_in_flight" not in Welcome("s", 0, False, 1 << 20, 64).encode()
    for bad, match in [(Assumed(5, (0,)), "earlier steps"), (Assumed(3, ()), "at least its root")]:
        wrong = Step(5, (), (9,), BlockStructure.chain(), torch.zeros(1, D), "float32", (bad,))
        with pytest.raises(ProtocolError, match=match):
            decode_client_message(wrong.encode(), limits)


SCENARIOS = [
    test_blocks_in_flight_assume_the_live_blocks_and_resolve_oldest_first,
    test_the_last_block_in_flight_lands_then_resolves,
    test_blocks_resolved_with_no_step_between_are_committed_by_the_next_step,
    test_a_loss_with_blocks_in_flight_rebuilds_the_session,
    test_rows_left_unemitted_can_be_forgotten_after_a_loss,
    test_a_new_session_numbers_steps_and_carries_the_keep_list,
    test_a_lost_connection_resumes_the_session_in_step,
    lambda: test_a_resumed_session_out_of_step_is_ended_and_rebuilt(dict(committed=7, next_seq=3)),
    test_a_loss_during_replay_starts_the_rebuild_over,
    test_uncommit_shortens_the_keep_list_and_the_history,
    test_a_closed_link_refuses_everything_but_close,
    test_retries_are_counted_per_block_and_run_out,
]


def test_the_scenarios_take_every_client_transition(monkeypatch):
    taken: set = set()
    real = link_module.transition

    def recording(state, event):
        after = real(state, event)
        taken.add((state, event))
        return after

    monkeypatch.setattr(link_module, "transition", recording)
    for scenario in SCENARIOS:
        scenario()
    every = {key for key in TRANSITIONS if isinstance(key[0], Client) and key[1] != "close"}
    assert every - taken == set()


# -- the server ------------------------------------------------------------------------------------------

HELLO = Hello("f" * 64, (2, 5), "float32")


def step(seq=0, keep=(), positions=(0,), structure=None, dtype="float32") -> Step:
    q = len(positions)
    structure = structure or (BlockStructure.chain() if q == 1 else BlockStructure.tree(list(range(-1, q - 1))))
    return Step(seq, keep, positions, structure, torch.zeros(q, D), dtype)


def test_the_server_wants_hello_before_any_step():
    link = ServerLink(max_errors=3)
    with pytest.raises(ProtocolError, match="send hello before the first step"):
        link.check(step())
    assert link.check(Probe(1, 0)) is Server.AWAIT_HELLO  # path measurement needs no session
    assert link.state is Server.AWAIT_HELLO  # checking does not move
    link.moved(HELLO, "s1")
    assert link.state is Server.OPEN and link.session_id == "s1"
    assert link.check(step()) is Server.OPEN and link.check(HELLO) is Server.OPEN
    link.moved(step())
    assert link.session_id == "s1"
    link.moved(Close())
    assert link.state is Server.CLOSED and link.session_id is None
    for message in (HELLO, step(), Probe(1, 0), Close()):
        with pytest.raises(ProtocolError, match="while the link is closed"):
            link.check(message)


def test_the_server_link_counts_protocol_errors_only():
    from splitinfer.errors import SessionError

    link = ServerLink(max_errors=2)
    assert not link.refused(ProtocolError("x")) and not link.refused(SessionError("expired"))
    assert link.refused(ProtocolError("y")) and link.errors == 2


PENDING = (PendingBlock(2, (5, 6, 6)),)  # the previous block: a tree of root 5 with two children at 6


def test_a_valid_step_returns_the_committed_rows_after_its_keep_list():
    plan = check_step(step(3, (0, 2), (7, 8)), 3, "float32", 5, PENDING, LIMIT)
    assert (plan.resolves, plan.pending, plan.committed) == (((0, 2),), (), 7)
    matrix = BlockStructure.matrix(torch.eye(2, dtype=torch.bool).numpy())
    assert check_step(step(0, (), (1, 0), matrix), 0, "float32", 0, (), LIMIT).committed == 0


@pytest.mark.parametrize(
    "bad, match",
    [
        (step(seq=4, keep=(0,), positions=(6,)), "seq 4 is out of order; the session expects 3"),
        (step(seq=3, keep=(0,), positions=(6,), dtype="float16"), "float16, but the session uses float32"),
        (step(seq=3, keep=(3,), positions=(6,)), "beyond the previous block of 3 rows"),
        (step(seq=3, keep=(1,), positions=(6,)), "contiguous path"),
        (step(seq=3, keep=(0, 1, 2), positions=(8,)), "contiguous path"),  # rows 1 and 2 are siblings
        (step(seq=3, keep=(0,), positions=(7,)), r"committed length \(6\) plus each row's depth"),
        (step(seq=3, keep=(), positions=(7, 5), structure=BlockStructure.matrix(torch.eye(2, dtype=torch.bool).numpy())),
         r"lie in \[5, 7\)"),
    ],
)
def test_steps_that_break_the_session_rules_are_refused(bad, match):
    with pytest.raises(ProtocolError, match=match):
        check_step(bad, 3, "float32", 5, PENDING, LIMIT)


def test_a_step_past_the_model_context_is_refused():
    assert check_step(step(3, (0, 1), (7,)), 3, "float32", 5, PENDING, 8).committed == 7
    with pytest.raises(ProtocolError, match="position 7 exceeds the model's context of 7 tokens"):
        check_step(step(3, (0, 1), (7,)), 3, "float32", 5, PENDING, 7)


def test_a_resume_keeps_the_dtype_and_the_head_depth():
    check_resume(HELLO, "float32", 3, 3)
    with pytest.raises(ProtocolError, match="cannot change its wire dtype"):
        check_resume(HELLO, "float16", 3, 3)
    with pytest.raises(ProtocolError, match=r"cannot change its head depth on resume \(3 -> 4\)"):
        check_resume(HELLO, "float32", 3, 4)


# -- the server's rules for blocks in flight ---------------------------------------------------------------

A = PendingBlock(2, (5, 6, 6))  # a tree: root 5, two children at 6
B = PendingBlock(3, (7, 8), (Assumed(2, (0, 1)),))  # ran assuming A keeps rows 0 and 1


def ahead_step(seq, keep, positions, assume) -> Step:
    return Step(seq, keep, positions, BlockStructure.chain(), torch.zeros(len(positions), D), "float32", assume)


def test_a_step_may_assume_the_pending_blocks_and_resolve_the_oldest():
    plan = check_step(ahead_step(3, (), (7, 8), (Assumed(2, (0, 1)),)), 3, "float32", 5, (A,), LIMIT, 3)
    assert (plan.resolves, plan.pending, plan.committed) == ((), (A,), 5)
    plan = check_step(ahead_step(4, (0, 1), (8,), (Assumed(3, (0,)),)), 4, "float32", 5, (A, B), LIMIT, 3)
    assert (plan.resolves, plan.pending, plan.committed) == (((0, 1),), (PendingBlock(3, (7, 8)),), 7)
    plan = check_step(ahead_step(4, (0, 2), (7,), ()), 4, "float32", 5, (A, B), LIMIT, 3)
    assert (plan.resolves, plan.pending, plan.committed) == (((0, 2),), (), 7)  # B's assumption failed: dropped
    both = (Assumed(2, (0, 1)), Assumed(3, (0, 1)))
    assert check_step(ahead_step(4, (), (9,), both), 4, "float32", 5, (A, B), LIMIT, 3).pending == (A, B)


@pytest.mark.parametrize(
    "bad, pending, match",
    [
        (ahead_step(4, (0, 2), (8,), (Assumed(3, (0,)),)), (A, B), r"valid blocks in flight on this session are \[\]"),
        (ahead_step(3, (0,), (7,), (Assumed(2, (0, 1)),)), (A,), "cannot also keep rows of it"),
        (ahead_step(4, (), (9,), (Assumed(3, (0, 1)),)), (A, B), "assume them oldest first"),
        (ahead_step(3, (), (7,), (Assumed(2, (1,)),)), (A,), "assume: kept rows must form a contiguous path"),
        (ahead_step(3, (), (7,), (Assumed(2, (0, 3)),)), (A,), "beyond the assumed block of 3 rows"),
        (ahead_step(3, (), (8,), (Assumed(2, (0, 1)),)), (A,), r"committed length \(7\)"),
        (ahead_step(4, (), (8,), (Assumed(2, (0, 2)), Assumed(3, (0,)))), (A, B), "ran assuming other rows"),
        (ahead_step(4, (), (8, 9, 10), (Assumed(2, (0,)), Assumed(3, (0,)), Assumed(3, (0,)))), (A, B), "at most 2"),
    ],
)
def test_bad_or_inconsistent_assumptions_are_refused(bad, pending, match):
    with pytest.raises(ProtocolError, match=match):
        check_step(bad, bad.seq, "float32", 5, pending, LIMIT, 3)


def test_a_session_without_v3_refuses_assumptions():
    with pytest.raises(ProtocolError, match=r"allows 1 block\(s\) in flight"):
        check_step(ahead_step(3, (), (7,), (Assumed(2, (0, 1)),)), 3, "float32", 5, (A,), LIMIT)


def test_a_later_step_that_names_neither_a_block_nor_what_follows_it_drops_it():
    a = ahead_step(3, (), (7, 8), (Assumed(2, (0, 1)),))  # sent ahead of block 2
    builds_on_a = ahead_step(4, (), (9,), (Assumed(2, (0, 1)), Assumed(3, (0, 1))))
    resolves_a = ahead_step(4, (0, 1), (9,), (Assumed(3, (0,)),))  # a resolved with keep: a was answered
    drops_a = ahead_step(4, (0,), (7,), ())  # 2 kept one row: a's assumption failed, the client dropped it
    assert not dropped(a, []) and not dropped(a, [builds_on_a]) and not dropped(a, [resolves_a])
    assert dropped(a, [drops_a]) and dropped(a, [builds_on_a, ahead_step(5, (0,), (7,), ())])
    assert not dropped(drops_a, [a])  # only later steps speak for a step


def test_a_skipped_step_may_build_on_a_block_skipped_before_it():
    """Steps 4 and 5 were dropped while queued, 5 built on 4 and resolves A: the server never ran 4, so a
    step that runs may not name it, but skipped, 5 still resolves A and leaves B for the step that keeps it."""
    on_skipped = ahead_step(5, (0, 1), (9,), (Assumed(3, (0, 1)), Assumed(4, (0,))))
    with pytest.raises(ProtocolError, match=r"valid blocks in flight on this session are \[3\]"):
        check_step(on_skipped, 5, "float32", 5, (A, B), LIMIT, 3)
    plan = check_step(on_skipped, 5, "float32", 5, (A, B), LIMIT, 3, skip=True)
    assert (plan.resolves, plan.pending, plan.committed) == (((0, 1),), (PendingBlock(3, (7, 8)),), 7)
    assert check_step(ahead_step(6, (0, 1), (9,), ()), 6, "float32", 7, plan.pending, LIMIT, 3).committed == 9
    wrong_rows = ahead_step(5, (0, 1), (9,), (Assumed(3, (1,)), Assumed(4, (0,))))  # B is not on that path
    assert check_step(wrong_rows, 5, "float32", 5, (A, B), LIMIT, 3, skip=True).pending == ()
    with pytest.raises(ProtocolError, match="keep: kept rows must form a contiguous path"):  # still checked
        check_step(ahead_step(5, (1,), (9,), ()), 5, "float32", 5, (A, B), LIMIT, 3, skip=True)


def test_a_skipped_reply_is_taken_only_for_a_dropped_block():
    link = pipelined()
    a = ahead(link, 5, 3, [])
    b = ahead(link, 8, 1, [(0, 1, 2)])
    c = ahead(link, 9, 1, [(0, 1, 2), (0,)])
    skipped = Result(c.seq, torch.empty(0, D), 0.0, 1.0, 5, "float32", skipped=True)
    wire = decode_server_message(skipped.encode(), Limits(hidden_size=D, dtypes=("float32",)))
    assert wire.skipped and wire.hidden.shape == (0, D) and wire.seq == c.seq
    assert b"tensor" not in skipped.encode() and b"skipped" not in answer(a, 5).encode()
    link.on_result(answer(a, 5))
    link.resolve([0])  # a kept less than b assumed: b and c are dropped
    link.drop_live()
    assert link.on_result(answer(b, 5)) is None and link.on_result(wire) is None and link.state is Client.READY
    link = pipelined()
    a = ahead(link, 5, 3, [])
    with pytest.raises(ProtocolError, match="skipped block 1"):  # the client still wants a
        link.on_result(Result(a.seq, torch.empty(0, D), 0.0, 1.0, 5, "float32", skipped=True))


# -- a block with several candidate roots (decoding/roots.py) ----------------------------------------------

ROOTS = BlockStructure.tree([-1, -1, -1, 0, 1])  # three sibling roots, a child below the first and the second


def test_a_block_with_several_roots_travels_and_is_checked_like_any_tree():
    """Several parent -1 rows need no rule of their own: each sits at the committed length, and a keep list
    or an assumption may start from any of them."""
    message = Step(3, (0, 2), (7, 7, 7, 8, 8), ROOTS, torch.zeros(5, D), "float32")
    decoded = decode_client_message(message.encode(), Limits(hidden_size=D))
    assert decoded.structure == ROOTS and decoded.structure.depths(5) == [0, 0, 0, 1, 1]
    assert check_step(decoded, 3, "float32", 5, PENDING, LIMIT).committed == 7
    multi = (PendingBlock(3, (7, 7, 7, 8, 8)),)
    assert check_step(step(4, (1, 4), (9,)), 4, "float32", 7, multi, LIMIT).resolves == ((1, 4),)
    assert check_step(step(4, (2,), (8,)), 4, "float32", 7, multi, LIMIT).committed == 8
    ahead = ahead_step(4, (), (9,), (Assumed(3, (1, 4)),))
    assert check_step(ahead, 4, "float32", 7, multi, LIMIT, 3).pending == multi


@pytest.mark.parametrize(
    "bad, match",
    [
        (step(4, (0, 1), (9,)), "contiguous path"),  # two sibling roots are not a path
        (step(4, (3,), (8,)), "contiguous path"),  # a path must start at a root
    ],
)
def test_keep_lists_of_a_several_root_block_stay_paths(bad, match):
    # The server knows a pending block's positions, not its parents, so it checks a path by positions (as for
    # one root): which root's rows the client keeps is the client's own business.
    with pytest.raises(ProtocolError, match=match):
        check_step(bad, 4, "float32", 7, (PendingBlock(3, (7, 7, 7, 8, 8)),), LIMIT)


def test_roots_of_one_block_share_one_position():
    with pytest.raises(ProtocolError, match=r"committed length \(7\) plus each row's depth"):
        check_step(step(3, (0, 2), (7, 8, 9, 8, 9), ROOTS), 3, "float32", 5, PENDING, LIMIT)
