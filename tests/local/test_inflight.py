"""Blocks in flight over a real WebSocket: greedy output identical to one block at a time for D = 1, 2, 3 on
tiny Llama, Mistral and Qwen2, with forced mispredictions, a dropped link, an old server, and sampling."""

from __future__ import annotations

import asyncio
import time

import pytest

from splitinfer.cloud import sessions as sessions_module
from splitinfer.cloud.batch import LocalPasses
from splitinfer.cloud.passtime import MinPassTime
from splitinfer.cloud.server import ServerConfig, ServerThread
from splitinfer.cloud.sessions import SessionConfig
from splitinfer.decoding.draft import Draft, children_of
from splitinfer.decoding.headsource import AheadTree
from splitinfer.decoding.loop import decode
from splitinfer.decoding.sampling import SamplingConfig, make_chooser
from splitinfer.decoding.strategies import Lookahead, LookaheadConfig, Strategy, Tree, TreeConfig
from splitinfer.clients import open_client
from splitinfer.local.middle import RemoteMiddle
from splitinfer.local.session import AUTO_IN_FLIGHT, ClientConfig, SplitSession
from splitinfer.model.shards import load_cloud, load_local

from clock import FakeClock, expire_all
from tiny import hf_greedy, prepare_tiny, random_head

PROMPT = [3, 17, 42, 5, 88, 21, 9, 60, 33, 7, 14, 2, 71, 3, 17, 42, 5, 88]
N = 24


class Scripted(Strategy):
    """Drafts from a known continuation, wrong on purpose now and then; and its guesses of the next root (what
    a block in flight assumes) are wrong every third time, so blocks in flight are dropped and sent again, and
    missing every seventh time, so two blocks resolve with no step sent between them."""

    name = "scripted"

    def __init__(self, text: list[int]):
        self.text, self.proposed, self.predicted = text, 0, 0

    def _next(self, history: list[int], n: int) -> list[int]:
        if history != self.text[: len(history)]:
            return []
        return self.text[len(history) : len(history) + n]

    def propose(self, history):
        self.proposed += 1
        tokens = self._next(history, 1 + self.proposed % 3)
        if tokens and self.proposed % 4 == 0:
            tokens[-1] = (tokens[-1] + 1) % 96  # a draft the model rejects at its last node
        return Draft(tokens=tokens, parents=list(range(len(tokens))), scores=[0.9] * len(tokens))

    def predict(self, history, nodes):
        self.predicted += 1
        if self.predicted % 7 == 0:
            return Draft()
        guess = self._next(history, 1) or [history[-1]]
        if self.predicted % 3 == 0:
            guess = [(guess[0] + 1) % 96]  # a root the model does not choose: the block in flight is dropped
        return Draft(tokens=guess, parents=[0], scores=[0.5])


class Ranked(Scripted):
    """Guesses three candidate roots for what follows a block in flight, the right one first, second or third
    by turns over the positions asked about, or not among them every fourth time; a predicted child below each of the first two (the right
    next token below the right root), so a block is accepted from a root other than its first row and along
    a predicted draft below it."""

    def __init__(self, text: list[int]):
        super().__init__(text)
        self.ranks: dict[int, int] = {}

    def propose(self, history):
        draft = super().propose(history)
        draft.scores = [0.99] * len(draft)  # confident: a block after it assumes its whole path kept (roots.py)
        return draft

    def predict(self, history, nodes):
        truth = self._next(history, 2) or [history[-1]]
        rank = self.ranks.setdefault(len(history), len(self.ranks) % 4)  # by turns over positions asked about
        wrong = [t % 96 for t in range(truth[0] + 1, truth[0] + 4)]
        firsts = wrong[:rank] + [truth[0]] + wrong[rank:2] if rank < 3 else wrong
        scores = [0.5, 0.3, 0.1]
        below = [truth[1] if len(truth) > 1 and t == truth[0] else (t + 7) % 96 for t in firsts[:2]]
        return Draft(tokens=firsts + below, parents=[0, 0, 0, 1, 2], scores=scores + [0.3, 0.2])


def resolved_rows(monkeypatch) -> list[list[int]]:
    """Every keep list `SplitSession.resolve` is given, in order."""
    rows: list[list[int]] = []
    resolve = SplitSession.resolve

    def recording(self, kept, assumption=None):
        rows.append(list(kept))
        return resolve(self, kept, assumption)

    monkeypatch.setattr(SplitSession, "resolve", recording)
    return rows


def config(depth: int) -> ClientConfig:
    return ClientConfig(wire_dtype="float32", prefill_chunk=8, retry_backoff_s=0.05, in_flight=depth)


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2"])
def served(request, tmp_path_factory):
    model, shards = prepare_tiny(tmp_path_factory.mktemp("inflight"), request.param, 2, 2)
    expected = hf_greedy(model, PROMPT, N)
    with ServerThread(load_cloud(shards / "cloud")) as server:
        yield shards, server, expected


def remote(local, url: str) -> RemoteMiddle:
    split = local.manifest["split"]
    return RemoteMiddle(url, local.fingerprint, tuple(split["cloud_layers"]), local.config.hidden_size, "float32")


@pytest.mark.parametrize("depth", [1, 2, 3, AUTO_IN_FLIGHT])
def test_greedy_output_is_identical_with_blocks_in_flight(served, depth):
    shards, server, expected = served
    client = open_client(shards / "local", server.url, config(depth), allow_public_weights=True, checks=False)
    for strategy in (Scripted(PROMPT + expected), "tree"):
        generation = client.generate(PROMPT, max_new_tokens=N, strategy=strategy, stop_ids=set())
        assert generation.token_ids == expected
        kinds = [s["kind"] for s in generation.steps]
        if isinstance(strategy, Scripted) and depth != AUTO_IN_FLIGHT:  # forced mispredictions: some were dropped
            assert ("dropped" in kinds) == (depth > 1)
    assert len(server.server.table) == 0 or all(s.busy == 0 for s in server.server.table._sessions.values())


def test_a_strategy_with_no_guesses_decodes_as_one_block_at_a_time(served):
    """Lookahead guesses nothing ahead, so with D = 2 it sends one block at a time and must see every row's
    logits, its window's included, exactly as decoding without blocks in flight: the same blocks result."""
    shards, server, expected = served
    local = load_local(shards / "local")
    steps = []
    for depth in (1, 2):
        tokens, session = run(local, remote(local, server.url), Lookahead(LookaheadConfig(window=3)), depth)
        assert tokens == expected
        steps.append([(r.rows, r.accepted) for r in session.records if r.kind == "decode"])
    assert steps[0] == steps[1] and any(rows > 1 for rows, _ in steps[0])


class Unlikely(Scripted):
    """Guesses the next root wrong, with low scores: never worth a block ahead, whatever the costs."""

    def predict(self, history, nodes):
        guess = self._next(history, 1) or [history[-1]]
        return Draft(tokens=[(guess[0] + 1) % 96], parents=[0], scores=[0.05])


def test_the_controller_sends_nothing_ahead_when_the_assumption_rarely_holds(served):
    shards, server, expected = served
    local = load_local(shards / "local")
    tokens, session = run(local, remote(local, server.url), Unlikely(PROMPT + expected), AUTO_IN_FLIGHT)
    assert tokens == expected and session.in_flight == 3 and not session.pinned
    decode_steps = [r for r in session.records if r.kind != "prefill"]
    assert all(r.assumed == 0 and r.kind == "decode" for r in decode_steps)
    checked = [r for r in decode_steps if r.ahead_held is not None]  # every guess was checked, none held
    assert checked and not any(r.ahead_held for r in checked)
    # pinned, the same guesses go ahead all the same (and are dropped): --in-flight N is a pin
    tokens, session = run(local, remote(local, server.url), Unlikely(PROMPT + expected), 2)
    assert tokens == expected and any(r.kind == "dropped" for r in session.records)


class LateClock:
    """The wall clock plus the delays a slow middle added: what the decoding loop measures, waited for by no one."""

    def __init__(self):
        self.late = 0.0

    def __call__(self) -> float:
        return time.perf_counter() + self.late


class Slowed(RemoteMiddle):
    """A reply that comes back 40 ms late on the loop's clock: a long round trip in front of a fast cloud."""

    clock: LateClock

    def collect(self):
        self.clock.late += 0.04
        return super().collect()


def test_the_controller_sends_ahead_behind_a_long_round_trip(served):
    shards, server, expected = served
    local = load_local(shards / "local")
    middle = Slowed.for_shard(server.url, local.manifest, local.config.hidden_size, "float32")
    middle.clock = LateClock()
    tokens, session = run(local, middle, Scripted(PROMPT + expected), AUTO_IN_FLIGHT, clock=middle.clock)
    assert tokens == expected
    assert any(r.assumed > 0 for r in session.records)  # a block went ahead once the round trip was measured
    first = next(i for i, r in enumerate(session.records) if r.kind != "prefill")
    assert session.records[first].assumed == 0 and session.records[first + 1].assumed == 0  # not before that


def run(local, middle, strategy, depth: int, hook=lambda i, session: None, choose=None, clock=time.perf_counter):
    session = SplitSession(local, middle, config(depth))
    tokens: list[int] = []

    def emit(token, _logprob):
        tokens.append(token)
        hook(len(tokens), session)

    logits = session.prefill(PROMPT)
    decode(session, list(PROMPT), logits, N, set(), emit, strategy, choose or make_chooser(None), clock=clock)
    session.close()
    return tokens, session


@pytest.mark.parametrize("guesses", ["one root", "several roots"])
def test_a_dropped_link_with_blocks_in_flight_recovers_with_identical_output(served, guesses):
    shards, server, expected = served
    local = load_local(shards / "local")

    def drop(i, session):
        if i in (5, 13):
            assert session.link.flying  # blocks are in flight when the link goes
            session.middle._ws.close()

    strategy = (Scripted if guesses == "one root" else Ranked)(PROMPT + expected)
    tokens, session = run(local, remote(local, server.url), strategy, 2 if guesses == "one root" else 3, drop)
    assert tokens == expected
    assert sum(r.recoveries for r in session.records) == 2


@pytest.mark.parametrize("guesses", ["one root", "several roots"])
def test_ttl_expiry_with_blocks_in_flight_recovers_with_identical_output(served, guesses, settle):
    shards, _, expected = served
    local = load_local(shards / "local")
    clock = FakeClock()
    with ServerThread(load_cloud(shards / "cloud"), ServerConfig(port=0, sessions=SessionConfig(ttl_s=10))) as server:
        table = server.server.table
        table.clock = clock  # set before any session opens; the server's sweep reads it too

        def idle(i, session):
            if i == 6:
                assert session.link.flying
                # as in a real idle spell, the block in flight is answered before the session expires
                cloud = table.get(session.link.welcome.session_id)
                assert settle(lambda: cloud.busy == 0)
                clock.advance(11)  # longer than the TTL: the server drops the session, blocks in flight and all
                assert expire_all(table)

        strategy = (Scripted if guesses == "one root" else Ranked)(PROMPT + expected)
        tokens, session = run(local, remote(local, server.url), strategy, 2, idle)
    assert tokens == expected
    assert sum(r.recoveries for r in session.records) == 1


def test_an_old_server_gets_one_block_at_a_time(served, monkeypatch):
    shards, server, expected = served
    monkeypatch.setattr(sessions_module, "SUPPORTED_VERSIONS", (1, 2))  # a server from before v3
    local = load_local(shards / "local")
    tokens, session = run(local, remote(local, server.url), Scripted(PROMPT + expected), 3)
    assert tokens == expected
    assert session.in_flight == 1 and session.link.welcome.version == 1
    assert all(r.kind != "dropped" for r in session.records)


def test_sampling_with_blocks_in_flight_reproduces_one_block_at_a_time(served):
    shards, server, _ = served
    local = load_local(shards / "local")
    sampling = SamplingConfig(temperature=1.0, seed=7)
    outputs = []
    for depth in (1, 2):
        text = PROMPT + run(local, remote(local, server.url), Strategy(), 1, choose=make_chooser(sampling))[0]
        tokens, _ = run(local, remote(local, server.url), Scripted(text), depth, choose=make_chooser(sampling))
        outputs.append(tokens)
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("depth", [2, 3])
def test_blocks_with_several_roots_give_identical_output(served, depth, monkeypatch):
    shards, server, expected = served
    local = load_local(shards / "local")
    rows = resolved_rows(monkeypatch)
    tokens, session = run(local, remote(local, server.url), Ranked(PROMPT + expected), depth)
    assert tokens == expected
    # accepted from a root other than the first (the one equal to the token chosen; from any other row the
    # output would differ), and along the predicted draft below it
    assert any(kept[0] > 0 and len(kept) > 1 for kept in rows)
    assert any(r.kind == "dropped" for r in session.records)  # no root was right: dropped
    assert any(r.rows >= 3 and r.assumed for r in session.records)


def test_sampling_with_several_root_blocks_reproduces_one_block_at_a_time(served):
    shards, server, _ = served
    local = load_local(shards / "local")
    sampling = SamplingConfig(temperature=1.0, seed=11)
    text = PROMPT + run(local, remote(local, server.url), Strategy(), 1, choose=make_chooser(sampling))[0]
    tokens, session = run(local, remote(local, server.url), Ranked(text), 2, choose=make_chooser(sampling))
    assert PROMPT + tokens == text
    assert any(r.rows >= 3 and r.assumed for r in session.records)


@pytest.mark.parametrize("guesses", ["one root", "several roots"])
def test_a_block_dropped_while_queued_is_never_computed(served, guesses):
    """With a slow cloud and three blocks in flight, the step that drops two blocks arrives while the second
    still waits behind the first: the server applies it without a pass, and the output does not change. With
    several roots, a dropped block can itself be built on by the next dropped one, which the server skips
    too although it never ran the block it names."""
    shards, _, expected = served
    local = load_local(shards / "local")
    config = ServerConfig(port=0, sessions=SessionConfig(max_in_flight=3))
    half = load_cloud(shards / "cloud")
    with ServerThread(half, config, MinPassTime(LocalPasses(half), 60)) as server:
        serve = server.server._serve_message

        async def queued(*args):  # every message waits its turn a while: later steps arrive meanwhile
            await asyncio.sleep(0.03)
            return await serve(*args)

        server.server._serve_message = queued
        table = server.server.table
        computed, skipped = [], []
        run_steps, skip_step = table.run_steps, table.skip_step

        def counting_run(items):
            computed.extend(step.seq for _, step, _ in items)
            return run_steps(items)

        def counting_skip(session, step, received_at):
            skipped.append(step.seq)
            return skip_step(session, step, received_at)

        table.run_steps, table.skip_step = counting_run, counting_skip
        strategy = (Scripted if guesses == "one root" else Ranked)(PROMPT + expected)
        tokens, session = run(local, remote(local, server.url), strategy, 3)
        stats = table.stats()
    assert tokens == expected
    assert skipped and not set(skipped) & set(computed)  # a skipped block never reached the model
    assert stats["skipped_steps"] == len(skipped)
    assert len(computed) + len(skipped) == len(session.records)  # every step sent was answered once


def _truthful(text: list[int], monkeypatch) -> None:
    """Make every tree a Tree drafts ahead assume the block's true outcome (what `text` says the model emits):
    its nodes are still the head's, drafted for the head's own guess, so the grafting path runs every step."""
    drafted_ahead = Tree.draft_ahead

    def truthful(self, history, draft):
        drafted_ahead(self, history, draft)
        n, row, kept = len(history), 0, []
        children = children_of(*draft.block(history[-1]))
        while n + len(kept) < len(text) and text[n + len(kept)] in children.get(row, {}):
            row = children[row][text[n + len(kept)]]
            kept.append(text[n + len(kept)])
        if self._ahead is not None and n + len(kept) < len(text):
            root = text[n + len(kept)]
            tree = self._ahead[2]
            self._ahead = (n + len(kept) + 1, [history[-1], *kept, root], AheadTree(kept, root, tree.nodes, 1.0))

    monkeypatch.setattr(Tree, "draft_ahead", truthful)


@pytest.mark.parametrize("truthful", [False, True])
def test_a_head_drafting_while_its_block_is_out_gives_identical_output(served, truthful, monkeypatch):
    """With a learned head and blocks that go without waiting, the tree drafts the next tree while a block is
    on the network and grafts it when the outcome it assumed comes (here once by chance, or every step where
    the assumption is made true): the output stays sequential greedy's."""
    shards, server, expected = served
    if truthful:
        _truthful(PROMPT + expected, monkeypatch)
    client = open_client(shards / "local", server.url, config(2), allow_public_weights=True, checks=False)
    # ahead_share: draft ahead every step, however short the tiny model's wait (the rule has its own test)
    tree = Tree(TreeConfig(fixed_nodes=8, ahead_share=1e9), head=random_head(client.local, vocab=64))
    generation = client.generate(PROMPT, max_new_tokens=N, strategy=tree, stop_ids=set())
    assert generation.token_ids == expected
    head = generation.stats["draft_head"]
    assert head["ahead"] > 0 and head["ahead_ms"] > 0
    if truthful:  # every tree drafted ahead but the last few is used
        assert head["ahead_used"] >= head["ahead"] - 2 > 0
    one_at_a_time = open_client(shards / "local", server.url, config(1), allow_public_weights=True, checks=False)
    tree = Tree(TreeConfig(fixed_nodes=8), head=random_head(client.local, vocab=64))
    stats = one_at_a_time.generate(PROMPT, max_new_tokens=N, strategy=tree, stop_ids=set()).stats["draft_head"]
    assert stats["ahead"] == 0  # one block at a time: the client waits, nothing is drafted ahead
