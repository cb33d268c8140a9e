"""Hostile input, both ways: fuzzed session state machine and live server, a hostile client next to an
honest one, oversized and repeated bad frames, and a lying server that the client must not believe.

SPLITINFER_FUZZ_EXAMPLES raises the example count of the fuzz tests (the longer campaign recorded in
docs/security.md).
"""

from __future__ import annotations

import os
import threading
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect
from websockets.sync.server import serve as sync_serve

from splitinfer.cloud.security import load_server_tokens
from splitinfer.cloud.server import ServerConfig, ServerThread
from splitinfer.cloud.sessions import SessionConfig, SessionTable
from splitinfer.errors import CapacityError, ProtocolError, SplitInferError
from splitinfer.local.auth import ClientAuth
from splitinfer.masks import BlockStructure
from splitinfer.model.shards import load_cloud, load_local
from splitinfer.wire.frame import decode_frame
from splitinfer.wire.messages import Close, Error, Hello, Limits, Result, Step, Welcome, decode_server_message

from security.sec_helpers import PROMPT, TOKEN_A, TOKEN_B, decode_with_hook, remote

EXAMPLES = int(os.environ.get("SPLITINFER_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=False)
D = 64  # hidden size of the tiny model


@pytest.fixture(scope="module")
def cloud(tiny):
    return load_cloud(tiny[0] / "cloud")


# -- the session state machine, fuzzed without a network -------------------------------------------------


@st.composite
def step_sequences(draw):
    """Up to 6 steps whose fields are near the valid ranges, so many pass validation and reach the layers."""
    out = []
    for seq_guess in range(draw(st.integers(1, 6))):
        q = draw(st.integers(1, 6))
        kind = draw(st.sampled_from(["chain", "tree", "matrix"]))
        if kind == "chain":
            structure = BlockStructure.chain()
        elif kind == "tree":
            structure = BlockStructure.tree([draw(st.integers(-1, i - 1)) for i in range(q)])
        else:
            allowed = np.array(draw(st.lists(st.booleans(), min_size=q * q, max_size=q * q))).reshape(q, q)
            np.fill_diagonal(allowed, True)
            structure = BlockStructure.matrix(allowed)
        out.append(dict(
            seq=draw(st.sampled_from([None, None, None, seq_guess, 0])),  # None: the seq the session expects
            keep=draw(st.one_of(
                st.integers(0, 6).map(lambda k: tuple(range(k))),  # a path prefix: valid if short enough
                st.sets(st.integers(0, 6), max_size=4).map(lambda k: tuple(sorted(k))),
            )),
            base=draw(st.sampled_from([0, 0, 0, -1, 1, 7])),
            q=q, structure=structure,
            scale=draw(st.sampled_from([1.0, 1e4, 6e4])),
            dtype=draw(st.sampled_from(["float32", "float32", "float32", "float16"])),  # the session is float32
        ))
    return out


def _run_plan(cloud, plan) -> Counter:
    """Run one fuzzed step sequence on a fresh table; counts the steps answered and refused."""
    outcomes: Counter = Counter()
    table = SessionTable(cloud, SessionConfig(max_cached_tokens=64))
    session, _ = table.open(Hello(cloud.fingerprint, (cloud.stack.start, cloud.stack.end), "float32"))
    gen = torch.Generator().manual_seed(len(plan))
    for item in plan:
        q = item["q"]
        depths = item["structure"].depths(q)
        offsets = depths if depths is not None else list(range(q))
        committed = session.cache.length + len(item["keep"])
        positions = tuple(max(0, committed + item["base"] + d) for d in offsets)
        hidden = (torch.randn(q, D, generator=gen) * item["scale"]).to(torch.float32)
        seq = session.next_seq if item["seq"] is None else item["seq"]
        step = Step(seq, item["keep"], positions, item["structure"], hidden, item["dtype"])
        before = _cache_state(session)
        try:
            result = table.run_step(session, step, 0.0)
        except SplitInferError:
            # A refused step changes nothing.
            assert _cache_state(session) == before
            outcomes["refused"] += 1
            continue
        assert result.hidden.shape == (q, D) and bool(torch.isfinite(result.hidden).all())
        # A block that ran stays uncommitted (held, or the last block) until a later step resolves it.
        assert session.cache.pending + session.cache.held_rows == q and session.rows <= 64
        outcomes["results"] += 1
    return outcomes


def _cache_state(session) -> tuple:
    return session.cache.length, session.cache.pending, tuple(session.cache.held), session.next_seq


def test_session_state_machine_fuzz(cloud):
    """Whatever sequence of decodable steps arrives, the table answers with a Result or one of our errors;
    and the campaign is only worth something if it ran steps through the layers as well as refusals."""
    outcomes: Counter = Counter()

    @FUZZ
    @given(step_sequences())
    def campaign(plan):
        outcomes.update(_run_plan(cloud, plan))

    campaign()
    print(f"state-machine fuzz: {dict(outcomes)}")
    assert outcomes["results"] > 0 and outcomes["refused"] > 0, outcomes


# -- a live server -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def live(tiny, cloud, tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokens"
    path.write_text(f"{TOKEN_A}\n{TOKEN_B}\n")
    config = ServerConfig(port=0, tokens=load_server_tokens(str(path)), sessions=SessionConfig(max_message_bytes=256 * 1024))
    with ServerThread(cloud, config) as server:
        yield server


def _hello(local) -> bytes:
    return Hello(local.fingerprint, tuple(local.manifest["split"]["cloud_layers"]), "float32").encode()


def _valid_step(seq=0, rows=3) -> bytes:
    return Step(seq, (), tuple(range(rows)), BlockStructure.chain(), torch.randn(rows, D), "float32").encode()


_SEEDS = [_valid_step(), _valid_step(rows=1), Hello("x" * 64, (2, 4), "float32").encode(), b"\x00\x00\x00\x02{}"]


@FUZZ
@given(
    st.lists(
        st.one_of(
            st.binary(max_size=400),
            st.tuples(st.sampled_from(_SEEDS), st.lists(st.tuples(st.integers(0, 2000), st.integers(0, 255)), max_size=6),
                      st.one_of(st.none(), st.integers(0, 1200))),
        ),
        min_size=1, max_size=5,
    )
)
def test_live_server_fuzz(live, tiny, frames):
    """Random and mutated frames after a valid hello: every reply is a well-formed server message, or the
    connection is closed by policy (1008) or for size (1009). Never a crash, never a hang."""
    local = load_local(tiny[0] / "local")
    with connect(live.url, compression=None, additional_headers={"Authorization": f"Bearer {TOKEN_B}"}) as ws:
        ws.send(_hello(local))
        assert isinstance(decode_server_message(ws.recv(timeout=10), Limits(hidden_size=D)), Welcome)
        for frame in frames:
            if isinstance(frame, tuple):
                seed, edits, cut = frame
                data = bytearray(seed)
                for pos, byte in edits:
                    data[pos % len(data)] = byte
                frame = bytes(data if cut is None else data[:cut])
            try:
                ws.send(frame)
                reply = decode_server_message(ws.recv(timeout=20), Limits(hidden_size=D, max_block_rows=1 << 16))
            except ConnectionClosed as exc:
                assert exc.rcvd is not None and exc.rcvd.code in (1000, 1008, 1009), exc
                return  # the session it opened is left to expire or be evicted, like any abandoned one
            if isinstance(reply, Error):
                assert reply.code in ("protocol", "too_large", "version", "shard_mismatch", "session", "capacity")
            else:
                assert isinstance(reply, (Result, Welcome))  # a mutation that is still a valid message
        ws.send(Close().encode())  # free the session, so thousands of examples do not fill the table


def test_server_still_exact_after_fuzzing(live, tiny):
    shards, expected = tiny
    local = load_local(shards / "local")
    tokens, _ = decode_with_hook(local, remote(local, live.url, ClientAuth(token=TOKEN_A)))
    assert tokens == expected


def test_hostile_client_beside_an_honest_one(live, tiny):
    """While one client generates, another (its own token) steals the session id, sends NaN, wrong shapes,
    out-of-order seqs, bad keeps and oversized frames. The honest output is unchanged."""
    shards, expected = tiny
    local = load_local(shards / "local")
    seen_ids: list[str] = []
    failures: list[BaseException] = []

    def attack():
        try:
            headers = {"Authorization": f"Bearer {TOKEN_B}"}
            sid = seen_ids[0]
            with connect(live.url, compression=None, additional_headers=headers) as ws:
                hello = Hello(local.fingerprint, tuple(local.manifest["split"]["cloud_layers"]), "float32", session_id=sid)
                ws.send(hello.encode())
                welcome = decode_server_message(ws.recv(timeout=10), Limits(hidden_size=D))
                assert not welcome.resumed and welcome.session_id != sid  # not the honest client's session
                nan = torch.full((2, D), float("nan"))
                for bad in (
                    _valid_step(seq=5),  # out of order
                    Step(0, (7,), (0,), BlockStructure.chain(), torch.randn(1, D), "float32").encode(),  # bad keep
                    Step(0, (), (9, 10), BlockStructure.chain(), torch.randn(2, D), "float32").encode(),  # positions
                    _valid_step()[:-4],  # byte count
                    _valid_step().replace(b'"float32"', b'"float64"'),
                    nan.numpy().tobytes(),
                ):
                    ws.send(bad)
                    assert decode_server_message(ws.recv(timeout=10), Limits(hidden_size=D)).code == "protocol"
                raw = bytearray(_valid_step(rows=2))
                raw[-8:] = np.array([np.nan, np.inf], dtype=np.float32).tobytes()
                ws.send(bytes(raw))
                assert "NaN" in decode_server_message(ws.recv(timeout=10), Limits(hidden_size=D)).message
                ws.send(b"\x00" * (300 * 1024))  # over the 256 KiB limit: websockets closes with 1009
                with pytest.raises(ConnectionClosed) as info:
                    ws.recv(timeout=10)
                assert info.value.rcvd.code == 1009
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    attacker = threading.Thread(target=attack)

    def hook(i, session):
        if i == 3:
            seen_ids.append(session.link.session_id)
            attacker.start()
        if i == 10:
            attacker.join(30)

    tokens, session = decode_with_hook(local, remote(local, live.url, ClientAuth(token=TOKEN_A)), hook)
    assert not failures, failures
    assert tokens == expected
    assert sum(r.recoveries for r in session.records) == 0  # the honest session was never disturbed


def test_repeated_bad_frames_close_the_connection(live):
    with connect(live.url, compression=None, additional_headers={"Authorization": f"Bearer {TOKEN_A}"}) as ws:
        with pytest.raises(ConnectionClosed) as info:
            for _ in range(100):
                ws.send(b"junk")
                header, _ = decode_frame(ws.recv(timeout=10))
                assert header["type"] == "error"
        assert info.value.rcvd.code == 1008


# -- a lying server ------------------------------------------------------------------------------------


def _liar(make_reply):
    """A fake server: a valid welcome, then `make_reply(step_bytes)` for each step."""

    def handler(ws):
        ws.recv()
        ws.send(Welcome("s", 0, False, 1 << 20, 64).encode())
        for message in ws:
            ws.send(make_reply(message))

    return sync_serve(handler, "127.0.0.1", 0, compression=None)


def _result(rows, width=D, committed=0, seq=0, value=0.5, dtype="float32"):
    hidden = torch.full((rows, width), value)
    return Result(seq, hidden, 1.0, 1.0, committed, dtype).encode()


@pytest.mark.parametrize(
    "reply, match",
    [
        (lambda m: _result(1), "returned 1 rows for a 8-row block"),
        (lambda m: _result(8, width=D + 1), "hidden size"),
        (lambda m: _result(8, committed=99), "committed rows"),
        (lambda m: _result(8, seq=3), "does not answer"),
        (lambda m: _result(8, dtype="float16"), "dtype"),
        (lambda m: _result(8).replace(b"\x00\x00\x00\x3f", b"\x00\x00\xc0\x7f"), "NaN"),
        (lambda m: b"\x00\x00\x00\x10not json at all!", "JSON"),
    ],
)
def test_client_rejects_a_lying_server(tiny, reply, match):
    shards, _ = tiny
    local = load_local(shards / "local")
    with _liar(reply) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"ws://127.0.0.1:{server.socket.getsockname()[1]}"
        with pytest.raises(ProtocolError, match=match):
            decode_with_hook(local, remote(local, url))
        server.shutdown()


def test_one_token_cannot_take_every_session(tiny, cloud):
    """With a per-token cap, a client that opens (and abandons) sessions runs out, the others do not."""
    local = load_local(tiny[0] / "local")
    table = SessionTable(cloud, SessionConfig(max_sessions=8, max_sessions_per_owner=3))
    hello = Hello(local.fingerprint, tuple(local.manifest["split"]["cloud_layers"]), "float32")
    for _ in range(3):
        table.open(hello, owner="greedy")
    with pytest.raises(CapacityError, match="already holds 3 sessions"):
        table.open(hello, owner="greedy")
    assert table.open(hello, owner="modest")[1].resumed is False
