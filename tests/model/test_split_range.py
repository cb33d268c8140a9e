"""Split-point randomisation (`prepare --split-range K1-K2`): shards, handshake, exactness, resume, batching."""

from __future__ import annotations

import json
import time

import pytest
import torch
from safetensors import safe_open
from websockets.sync.client import connect

import splitinfer.cloud.sessions as sessions_module
from splitinfer.model.commands import parse_split_range
from splitinfer.cloud.scheduler import BatchConfig, Scheduler
from splitinfer.cloud.server import ServerThread
from splitinfer.cloud.sessions import SessionConfig, SessionTable
from splitinfer.errors import ModelError, ProtocolError, SplitInferError, VersionMismatch
from splitinfer.clients import open_client
from splitinfer.local.client import SplitClient
from splitinfer.inprocess import InProcessMiddle
from splitinfer.local.middle import RemoteMiddle
from splitinfer.local.session import ClientConfig, SplitSession
from splitinfer.masks import BlockStructure
from splitinfer.model.manifest import WEIGHTS, Split, fingerprint, read_manifest
from splitinfer.model.prepare import prepare
from splitinfer.model.shards import load_cloud, load_local
from splitinfer.model.source import SourceModel
from splitinfer.wire.messages import Hello, Limits, Step, decode_client_message, decode_server_message

from model.test_exactness import PROMPT
from tiny import hf_greedy as reference, min_margin
from tiny import prepare_tiny, tiny_model

NEW_TOKENS = 16
RANGE = (2, 4)  # of the tiny model's 6 layers, with 1 tail layer: the cloud holds [2, 5)
F32 = ClientConfig(wire_dtype="float32", prefill_chunk=5, retry_backoff_s=0.001)


@pytest.fixture(scope="module")
def ranged(tmp_path_factory):
    model = tiny_model("llama")
    out = tmp_path_factory.mktemp("ranged")
    source = SourceModel("tiny-llama", model.config, model, None)
    prepare(source, out, tail_layers=1, dtype="float32", split_range=RANGE)
    expected = reference(model, PROMPT, NEW_TOKENS)
    assert min_margin(model, PROMPT, expected) > 1e-3  # the comparison is meaningful, not a tie
    return model, out, expected


def layer_indices(path) -> set[int]:
    with safe_open(str(path / WEIGHTS), "pt") as f:
        return {int(k.split(".")[2]) for k in f.keys() if k.startswith("model.layers.")}


def filled_slots(cache) -> list[int]:
    return [i for i, k in enumerate(cache._keys) if k is not None]


def pinned_client(local, make) -> SplitClient:
    return SplitClient(local, make, F32)


# -- shards and manifests ------------------------------------------------------------------------------
def test_shards_hold_the_range_and_the_fingerprint_covers_it(ranged, tmp_path):
    model, out, _ = ranged
    local, cloud = read_manifest(out / "local", "local"), read_manifest(out / "cloud", "cloud")
    for manifest in (local, cloud):
        assert manifest["split"]["head_range"] == [2, 4] and manifest["split"]["cloud_layers"] == [2, 5]
    assert layer_indices(out / "local") == {0, 1, 2, 3, 5}
    assert layer_indices(out / "cloud") == {2, 3, 4}
    # Same weights, same layers on the cloud, but the range is part of the fingerprint.
    fixed = prepare(SourceModel("tiny-llama", model.config, model, None), tmp_path / "fixed", 2, 1, "float32")
    fixed_manifest = read_manifest(fixed / "cloud", "cloud")
    assert "head_range" not in fixed_manifest["split"]
    assert fixed_manifest["files"] == cloud["files"]
    assert fixed_manifest["cloud_fingerprint"] != cloud["cloud_fingerprint"]
    expected_fp = fingerprint("tiny-llama", Split(6, 2, 1, head_max=4), "float32", cloud["files"])
    assert cloud["cloud_fingerprint"] == expected_fp


def test_fixed_split_manifest_is_unchanged():
    split = Split(30, 2, 2)
    assert split.as_dict() == {"num_layers": 30, "head_layers": 2, "tail_layers": 2, "cloud_layers": [2, 28]}
    assert split.head_range == (2, 2)


def test_bad_ranges_are_refused():
    with pytest.raises(ModelError, match="K1 < K2"):
        Split(6, 3, 1, head_max=3)
    with pytest.raises(ModelError, match="deepest head split"):
        Split(6, 2, 1, head_max=5)  # k = 5 would leave the cloud nothing
    assert parse_split_range("2-4") == (2, 4)
    for bad in ("4-2", "3-3", "0-2", "2", "a-b", "2-"):
        with pytest.raises(SplitInferError, match="K1-K2"):
            parse_split_range(bad)


# -- exactness -----------------------------------------------------------------------------------------
def test_in_process_exact_for_every_depth_and_caches_hold_only_their_layers(ranged):
    _, out, expected = ranged
    local, cloud = load_local(out / "local"), load_cloud(out / "cloud")
    for k in range(RANGE[0], RANGE[1] + 1):
        got = pinned_client(local, lambda k=k: InProcessMiddle(cloud, k)).generate(
            PROMPT, max_new_tokens=NEW_TOKENS, stop_ids=set(), strategy="tree"
        )
        assert got.token_ids == expected, k
        assert got.stats["head_layers"] == k
        # KV: the client's head cache holds layers [0, k), the cloud session's layers [k, 5) only.
        middle = InProcessMiddle(cloud, k)
        session = SplitSession(local, middle, F32)
        session.prefill(PROMPT)
        assert filled_slots(session.head_cache) == list(range(k))
        cloud_session = middle._session
        assert cloud_session.head_layers == k
        assert filled_slots(cloud_session.cache) == list(range(k - RANGE[0], 3))  # slots of layers [k, 5)
        assert cloud_session.kv_bytes_per_token == cloud.stack.kv_bytes_per_token() * (5 - k) // 3
        session.close()


def test_client_draws_every_depth_of_the_range(ranged):
    _, out, expected = ranged
    client = open_client(local_only=True, shards=out, config=ClientConfig(split_seed=7))
    seen = set()
    for _ in range(12):
        got = client.generate(PROMPT, max_new_tokens=4, stop_ids=set(), strategy="sequential")
        assert got.token_ids == expected[:4]
        seen.add(got.stats["head_layers"])
    assert seen == {2, 3, 4}


def test_over_websocket_exact_for_every_depth(ranged):
    _, out, expected = ranged
    local = load_local(out / "local")
    with ServerThread(load_cloud(out / "cloud")) as server:
        for k in range(RANGE[0], RANGE[1] + 1):
            def make(k=k):
                return RemoteMiddle(server.url, local.fingerprint, (2, 5), 64, "float32", head_layers=k)

            client = pinned_client(local, make)
            got = client.generate(PROMPT, max_new_tokens=NEW_TOKENS, stop_ids=set(), strategy="sequential")
            assert got.token_ids == expected, k
            assert got.stats["prefill_messages"] == 3
        # The public path: connect() draws k per generate call; a client without a pin (an old client) gets K1.
        client = open_client(out / "local", server.url, ClientConfig(wire_dtype="float32", split_seed=1), allow_public_weights=True, checks=False)
        runs = [client.generate(PROMPT, max_new_tokens=NEW_TOKENS, stop_ids=set()) for _ in range(8)]
        assert all(run.token_ids == expected for run in runs)
        assert {run.stats["head_layers"] for run in runs} == {2, 3, 4}
        unpinned = pinned_client(local, lambda: RemoteMiddle(server.url, local.fingerprint, (2, 5), 64, "float32"))
        got = unpinned.generate(PROMPT, max_new_tokens=NEW_TOKENS, stop_ids=set())
        assert got.token_ids == expected and got.stats["head_layers"] == 2


# -- handshake -----------------------------------------------------------------------------------------
def hello_reply(url: str, hello: Hello):
    with connect(url, compression=None) as ws:
        ws.send(hello.encode())
        return decode_server_message(ws.recv(timeout=10), Limits(hidden_size=64))


def test_server_rejects_a_depth_outside_its_range(ranged, tmp_path):
    _, out, _ = ranged
    local = load_local(out / "local")
    with ServerThread(load_cloud(out / "cloud")) as server:
        for k in (1, 5):
            reply = hello_reply(server.url, Hello(local.fingerprint, (2, 5), "float32", head_layers=k))
            assert reply.code == "shard_mismatch" and f"head depth {k}" in reply.message and "2..4" in reply.message
        reply = hello_reply(server.url, Hello(local.fingerprint, (2, 5), "float32", head_layers=3))
        assert reply.session_id and reply.version == 2
    # A fixed-split server accepts its own depth pinned explicitly, and no other.
    _, fixed = prepare_tiny(tmp_path, "llama", 2, 1)
    fixed_local = load_local(fixed / "local")
    with ServerThread(load_cloud(fixed / "cloud")) as server:
        reply = hello_reply(server.url, Hello(fixed_local.fingerprint, (2, 5), "float32", head_layers=3))
        assert reply.code == "shard_mismatch" and "fixed split" in reply.message
        assert hello_reply(server.url, Hello(fixed_local.fingerprint, (2, 5), "float32", head_layers=2)).session_id


def test_hello_versions_stay_compatible():
    limits = Limits(hidden_size=64)
    plain = Hello("abc", (2, 5), "float32")
    assert plain.version == 1 and b"head_layers" not in plain.encode()  # what servers before the feature accept
    pinned = Hello("abc", (2, 5), "float32", head_layers=3)
    assert pinned.version == 2
    assert decode_client_message(pinned.encode(), limits) == pinned
    # A pinned depth under v1 would be ignored by an old server: the decoder refuses the combination.
    raw = pinned.encode().replace(b'"version":2', b'"version":1')
    with pytest.raises(ProtocolError, match="head_layers"):
        decode_client_message(raw, limits)
    with pytest.raises(ProtocolError, match="head_layers"):
        decode_client_message(Hello("abc", (2, 5), "float32", head_layers=0).encode(), limits)


def test_a_server_without_the_feature_refuses_a_pinned_hello(ranged, monkeypatch):
    """Simulates a v1-only server: it answers a pinned hello with a version error, not wrong layers."""
    _, out, _ = ranged
    table = SessionTable(load_cloud(out / "cloud"), SessionConfig())
    monkeypatch.setattr(sessions_module, "SUPPORTED_VERSIONS", (1,))
    with pytest.raises(VersionMismatch, match="upgrade"):
        table.open(Hello(table.half.fingerprint, (2, 5), "float32", head_layers=3))
    assert table.open(Hello(table.half.fingerprint, (2, 5), "float32"))[0].head_layers == 2


# -- resume and re-prefill -----------------------------------------------------------------------------
def test_resume_keeps_the_depth(ranged):
    _, out, _ = ranged
    table = SessionTable(load_cloud(out / "cloud"), SessionConfig())
    fp = table.half.fingerprint
    session, _ = table.open(Hello(fp, (2, 5), "float32", head_layers=3))
    resumed, welcome = table.open(Hello(fp, (2, 5), "float32", session_id=session.id, head_layers=3))
    assert welcome.resumed and resumed is session
    for other in (4, None):  # None means K1 = 2
        with pytest.raises(ProtocolError, match="head depth on resume"):
            table.open(Hello(fp, (2, 5), "float32", session_id=session.id, head_layers=other))


def test_re_prefill_after_a_lost_session_keeps_the_depth(ranged):
    _, out, expected = ranged
    local, cloud = load_local(out / "local"), load_cloud(out / "cloud")
    middle = InProcessMiddle(cloud, 4)
    session = SplitSession(local, middle, F32)
    logits = session.prefill(PROMPT)
    tokens = [int(logits[-1].argmax())]
    lost = False
    while len(tokens) < NEW_TOKENS:
        if len(tokens) == 5 and not lost:
            middle.table.close(middle._session.id)  # the server forgets the session (TTL, restart)
            lost = True
        logits = session.run_block([tokens[-1]], BlockStructure.chain())
        session.commit([0])
        tokens.append(int(logits[-1].argmax()))
    assert tokens == expected
    assert sum(r.recoveries for r in session.records) == 1
    assert middle._session.head_layers == 4 and filled_slots(middle._session.cache) == [2]


# -- batching ------------------------------------------------------------------------------------------
def run_alone(half, k: int, hidden: torch.Tensor) -> torch.Tensor:
    table = SessionTable(half, SessionConfig())
    session, _ = table.open(Hello(half.fingerprint, (2, 5), "float32", head_layers=k))
    step = Step(0, (), tuple(range(hidden.shape[0])), BlockStructure.chain(), hidden, "float32")
    return table.run_step(session, step, time.perf_counter()).hidden


def test_mixed_depths_in_one_call_run_separately_and_exactly(ranged):
    _, out, _ = ranged
    half = load_cloud(out / "cloud")
    depths = [2, 3, 4, 3, 2, 4]
    inputs = [torch.randn(3 + i, 64, generator=torch.Generator().manual_seed(i)) for i in range(len(depths))]
    table = SessionTable(half, SessionConfig())
    items = []
    for k, hidden in zip(depths, inputs):
        session, _ = table.open(Hello(half.fingerprint, (2, 5), "float32", head_layers=k))
        step = Step(0, (), tuple(range(hidden.shape[0])), BlockStructure.chain(), hidden, "float32")
        items.append((session, step, 0.0))
    outcomes = table.run_steps(items)
    for k, hidden, result in zip(depths, inputs, outcomes):
        assert torch.allclose(result.hidden, run_alone(half, k, hidden), atol=2e-5), k
    # The depths really differ: running fewer layers gives other rows.
    assert not torch.allclose(run_alone(half, 2, inputs[0]), run_alone(half, 3, inputs[0]), atol=1e-2)


def test_scheduler_batches_only_sessions_of_one_depth(ranged):
    _, out, _ = ranged
    half = load_cloud(out / "cloud")
    table = SessionTable(half, SessionConfig())
    passes: list[list[int]] = []
    run_steps = table.run_steps

    def recording(items):
        passes.append([session.head_layers for session, _, _ in items])
        return run_steps(items)

    table.run_steps = recording
    depths = [2, 3, 4, 2, 3, 4, 2, 3]
    inputs = [torch.randn(4, 64, generator=torch.Generator().manual_seed(10 + i)) for i in range(len(depths))]
    sessions = [table.open(Hello(half.fingerprint, (2, 5), "float32", head_layers=k))[0] for k in depths]
    scheduler = Scheduler(table, BatchConfig(window_ms=200))
    try:
        # Hold the compute thread on one pass so that the rest queue up and are gathered together.
        blocker = table.open(Hello(half.fingerprint, (2, 5), "float32"))[0]
        big = torch.randn(512, 64, generator=torch.Generator().manual_seed(99))
        first = scheduler.submit(blocker, Step(0, (), tuple(range(512)), BlockStructure.chain(), big, "float32"), 0.0)
        futures = [
            scheduler.submit(s, Step(0, (), tuple(range(4)), BlockStructure.chain(), x, "float32"), 0.0)
            for s, x in zip(sessions, inputs)
        ]
        first.result(timeout=60)
        results = [f.result(timeout=60) for f in futures]
    finally:
        scheduler.close()
    assert all(len(set(p)) == 1 for p in passes), passes
    assert any(len(p) > 1 for p in passes), passes  # same-depth sessions did share a pass
    for k, x, result in zip(depths, inputs, results):
        assert torch.allclose(result.hidden, run_alone(half, k, x), atol=2e-5)


def test_manifest_round_trip_refuses_a_damaged_range(ranged, tmp_path):
    _, out, _ = ranged
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    path = copy / "cloud" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["split"]["head_range"] = [3, 4]  # does not start at head_layers
    path.write_text(json.dumps(manifest))
    with pytest.raises(ModelError, match="head_range"):
        load_cloud(copy / "cloud")


# -- the privacy measurement ---------------------------------------------------------------------------
def test_depth_identification_measures_the_randomised_range():
    """On a tiny model: the range's depths are collected even when the audit did not collect them, and the
    classifier is scored per row and per session against chance."""
    from types import SimpleNamespace

    import numpy as np

    from splitinfer.privacy.attackers import TrainConfig
    from splitinfer.privacy.collect import collect
    from splitinfer.privacy.corpus import Chunk, Corpus
    from splitinfer.privacy.defences import depth_identification

    rng = np.random.default_rng(0)
    chunks = [Chunk(i, "synthetic", rng.integers(0, 96, size=40).tolist()) for i in range(16)]
    corpus = Corpus(train=chunks[:10], test=chunks[10:])
    model = tiny_model("llama")
    audit = SimpleNamespace(
        model=model, corpus=corpus,
        config=SimpleNamespace(depths=(1, 2), train=TrainConfig(max_seconds=20)),
        train=collect(model, corpus.train, (1, 2), (1,)), test=collect(model, corpus.test, (1, 2), (1,)),
    )
    ident = depth_identification(audit, split_range=(2, 4))
    assert ident["chance"] == 0.5
    ranged = ident["split_range"]
    assert ranged["depths"] == [2, 3, 4] and ranged["chance"] == pytest.approx(1 / 3)
    for name in ("row statistics", "whole vector"):
        assert ranged[name]["n_rows"] == 3 * 6 * 40 and ranged[name]["n_sessions"] == 3 * 6
        assert 0.0 <= ranged[name]["row_accuracy"] <= 1.0 and 0.0 <= ranged[name]["session_accuracy"] <= 1.0
    # Random weights at different depths give different activations: the whole vector beats chance.
    assert ranged["whole vector"]["row_accuracy"] > 0.45, ranged
    # A range clipped by the model leaves no range: nothing is measured for it.
    assert "split_range" not in depth_identification(audit, split_range=(4, 5))
