"""The split session driving the link over a real cloud session table (in process, float32, tiny model):
replies lost after the cloud ran the step, a closed session on every exit path."""

from __future__ import annotations

import pytest
import torch

from splitinfer.decoding.loop import decode
from splitinfer.decoding.strategies import Sequential
from splitinfer.errors import ConfigError, TransportError
from splitinfer.inprocess import InProcessMiddle
from splitinfer.local.session import ClientConfig, SplitSession
from splitinfer.masks import BlockStructure
from splitinfer.model.shards import load_cloud, load_local
from splitinfer.wire.messages import Result, Step, Welcome
from splitinfer.wire.transport import StepIO

from tiny import prepare_tiny

PROMPT = [3, 17, 42, 5, 88, 21, 9, 60, 33, 7, 14, 2, 71]
F32 = ClientConfig(wire_dtype="float32", prefill_chunk=8, retry_backoff_s=0.001)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model, shards = prepare_tiny(tmp_path_factory.mktemp("session"), "llama", 2, 2)
    expected = model.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    return load_local(shards / "local"), load_cloud(shards / "cloud"), expected[0, len(PROMPT) :].tolist()


class RepliesLost:
    """A middle whose chosen replies are lost after the cloud ran the step (its seq and rows moved on)."""

    def __init__(self, inner: InProcessMiddle, lose: set[int]):
        self.inner = inner
        self.head_layers = inner.head_layers
        self.lose = lose  # 1-based step calls whose replies are lost
        self.calls = 0
        self.rows_sent = 0

    def open(self, resume_id: str | None = None) -> Welcome:
        return self.inner.open(resume_id)

    def step(self, step: Step) -> tuple[Result, StepIO]:
        self.calls += 1
        self.rows_sent += step.hidden.shape[0]
        reply = self.inner.step(step)
        if self.calls in self.lose:
            raise TransportError("the reply was lost on the way back.")
        return reply

    def close(self, end_session: bool = True) -> None:
        self.inner.close(end_session)


def generate(local, middle, n: int) -> tuple[list[int], SplitSession]:
    tokens: list[int] = []
    with SplitSession(local, middle, F32) as session:
        decode(session, PROMPT, session.prefill(PROMPT), n, set(), lambda t, _: tokens.append(t), Sequential())
    return tokens, session


def test_a_lost_reply_rebuilds_the_session_with_identical_output(tiny):
    """The cloud ran step 6 but the client never saw it: on resume its committed rows and seq disagree with
    the client's, so the client ends that session, re-sends its history into a new one and carries on."""
    local, cloud, expected = tiny
    middle = RepliesLost(InProcessMiddle(cloud), lose={6})
    tokens, session = generate(local, middle, 12)
    assert tokens == expected
    assert sum(r.recoveries for r in session.records) == 1
    committed_before_loss = len(PROMPT) + 3  # 2 prefill chunks, then decode steps 3..5 committed one row each
    assert middle.rows_sent == len(PROMPT) + 11 + 1 + committed_before_loss  # every step, the lost one, the replay
    assert len(middle.inner.table) == 0  # the stale session was ended, the new one closed at the end


def test_the_cloud_session_is_released_when_decoding_fails(tiny):
    local, cloud, _ = tiny
    middle = InProcessMiddle(cloud)
    with pytest.raises(RuntimeError, match="stop here"):
        with SplitSession(local, middle, F32) as session:
            session.prefill(PROMPT)
            assert len(middle.table) == 1
            raise RuntimeError("stop here")
    assert len(middle.table) == 0


def test_retries_run_out_and_the_loss_is_raised(tiny):
    local, cloud, _ = tiny
    middle = RepliesLost(InProcessMiddle(cloud), lose=set(range(1, 100)))
    config = ClientConfig(wire_dtype="float32", max_retries=2, retry_backoff_s=0.001)
    with pytest.raises(TransportError, match="reply was lost"):
        with SplitSession(local, middle, config) as session:
            session.prefill(PROMPT)
    assert middle.calls == 3 and sum(r.recoveries for r in session.records) == 0  # the failed block has no record
    assert len(middle.inner.table) == 0


def test_features_hand_on_the_states_that_crossed_the_wire(tmp_path):
    """features((k, N - m)): the final features, then HF's hidden states k and N - m of the same rows (a
    fused draft head's inputs), over a prefill's chunks and a decode block; a state off the wire is refused."""
    model, shards = prepare_tiny(tmp_path, "llama", 2, 2)  # 6 layers: state 2 is sent, state 4 received
    local, cloud = load_local(shards / "local"), load_cloud(shards / "cloud")
    with torch.no_grad():
        states = model(torch.tensor([PROMPT + [5]]), output_hidden_states=True).hidden_states
    d, n = local.config.hidden_size, len(PROMPT)
    with SplitSession(local, InProcessMiddle(cloud), F32) as session:
        session.prefill(PROMPT)  # two chunks of 8 rows
        rows = session.features((4, 2))
        assert rows.shape == (n, 3 * d)
        torch.testing.assert_close(rows[:, :d], session.features())
        torch.testing.assert_close(rows[:, d : 2 * d], states[4][0, :n], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(rows[:, 2 * d :], states[2][0, :n], rtol=1e-4, atol=1e-4)
        session.run_block([5], BlockStructure.chain())
        torch.testing.assert_close(session.features((2,))[:, d:], states[2][0, n:], rtol=1e-4, atol=1e-4)
        with pytest.raises(ConfigError, match="trained for another split"):
            session.features((3,))
