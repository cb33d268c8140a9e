"""The link protocol with no socket and no model: every client transition, the server's rules."""

from __future__ import annotations

import pytest
import torch

from splitinfer.errors import ProtocolError
from splitinfer.masks import BlockStructure
from splitinfer.wire import link as link_module
from splitinfer.wire.link import (
    TRANSITIONS, Answered, Block, Client, ClientLink, Open, Replayed, Server, ServerLink, check_resume, check_step,
)
from splitinfer.wire.messages import Close, Hello, Probe, Result, Step, Welcome

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


SCENARIOS = [
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
    link = ServerLink()
    with pytest.raises(ProtocolError, match="send hello before the first step"):
        link.check(step())
    assert link.check(Probe(1, 0)) is Server.AWAIT_HELLO  # path measurement needs no session
    assert link.state is Server.AWAIT_HELLO  # checking does not move
    link.state = link.check(HELLO)
    assert link.state is Server.OPEN
    assert link.check(step()) is Server.OPEN and link.check(HELLO) is Server.OPEN
    link.state = link.check(Close())
    for message in (HELLO, step(), Probe(1, 0), Close()):
        with pytest.raises(ProtocolError, match="while the link is closed"):
            link.check(message)


def test_a_valid_step_returns_the_committed_rows_after_its_keep_list():
    pending = (5, 6, 6)  # the previous block: a tree of root 5 with two children at 6
    assert check_step(step(3, (0, 2), (7, 8)), 3, "float32", 5, 3, pending, LIMIT) == 7
    matrix = BlockStructure.matrix(torch.eye(2, dtype=torch.bool).numpy())
    assert check_step(step(0, (), (1, 0), matrix), 0, "float32", 0, 0, (), LIMIT) == 0


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
        check_step(bad, 3, "float32", 5, 3, (5, 6, 6), LIMIT)


def test_a_step_past_the_model_context_is_refused():
    assert check_step(step(3, (0, 1), (7,)), 3, "float32", 5, 3, (5, 6, 6), 8) == 7
    with pytest.raises(ProtocolError, match="position 7 exceeds the model's context of 7 tokens"):
        check_step(step(3, (0, 1), (7,)), 3, "float32", 5, 3, (5, 6, 6), 7)


def test_a_resume_keeps_the_dtype_and_the_head_depth():
    check_resume(HELLO, "float32", 3, 3)
    with pytest.raises(ProtocolError, match="cannot change its wire dtype"):
        check_resume(HELLO, "float16", 3, 3)
    with pytest.raises(ProtocolError, match=r"cannot change its head depth on resume \(3 -> 4\)"):
        check_resume(HELLO, "float32", 3, 4)
