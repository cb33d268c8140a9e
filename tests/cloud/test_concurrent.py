"""Through the real server: concurrent clients batched together get the tokens they get alone; replicas
with session-affine routing each hold only their own sessions; a client moved to another replica recovers."""

from __future__ import annotations

import threading

import pytest
import torch

from splitinfer.cloud.routing import replica_for
from splitinfer.cloud.scheduler import BatchConfig
from splitinfer.cloud.server import ServerConfig, ServerThread
from splitinfer.decoding.loop import decode
from splitinfer.decoding.strategies import Sequential
from splitinfer.local.client import SplitClient
from splitinfer.local.middle import RemoteMiddle
from splitinfer.local.session import ClientConfig, SplitSession
from splitinfer.model.shards import load_cloud, load_local

from tiny import prepare_tiny

F32 = ClientConfig(wire_dtype="float32", prefill_chunk=8, retry_backoff_s=0.01)
STRATEGIES = ["sequential", "tree", "lookahead", "jacobi", "tree", "sequential"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return prepare_tiny(tmp_path_factory.mktemp("concurrent"), "mistral", 1, 1)[1]


def prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, 96, (5 + 7 * i,), generator=gen).tolist() for i in range(n)]


def run_clients(url: str, shards, jobs) -> list[list[int]]:
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def worker(i, prompt, strategy):
        try:
            client = SplitClient.connect(shards / "local", url, F32, allow_public_weights=True)
            results[i] = client.generate(prompt, max_new_tokens=24, stop_ids=set(), strategy=strategy).token_ids
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i, p, s)) for i, (p, s) in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return [results[i] for i in range(len(jobs))]


def test_concurrent_clients_batched_match_alone(shards):
    """Six clients (prompt lengths 5..40, past the sliding window of 12; four strategies) at once."""
    jobs = list(zip(prompts(6), STRATEGIES))
    cloud = load_cloud(shards / "cloud")
    with ServerThread(cloud, ServerConfig(port=0, batching=BatchConfig(max_batch=1))) as server:
        alone = [run_clients(server.url, shards, [job])[0] for job in jobs]
    with ServerThread(cloud, ServerConfig(port=0, batching=BatchConfig(window_ms=5))) as server:
        together = run_clients(server.url, shards, jobs)
        stats = server.server.scheduler.stats()
    assert together == alone
    assert stats["passes"] < stats["steps"] and max(stats["batch_sizes"]) > 1, stats


def test_replicas_with_session_affine_routing(shards):
    """Two replicas; each client is routed by its key; a client whose replica goes away re-prefills on the
    other one with identical output."""
    cloud = load_cloud(shards / "cloud")
    local = load_local(shards / "local")
    split = local.manifest["split"]
    with ServerThread(cloud) as a, ServerThread(cloud) as b:
        replicas = [a.url, b.url]
        keys = [f"org-{i}" for i in range(8)]
        routed = {key: replica_for(key, replicas) for key in keys}
        assert set(routed.values()) == set(replicas)  # both replicas get work
        assert all(replica_for(key, list(reversed(replicas))) == url for key, url in routed.items())
        middles = {}
        for key in keys:
            middles[key] = RemoteMiddle(routed[key], local.fingerprint, tuple(split["cloud_layers"]), 64, "float32")
            middles[key].open()
        by_url = {server.url: len(server.server.table) for server in (a, b)}
        assert by_url == {url: sum(1 for k in keys if routed[k] == url) for url in replicas}
        for middle in middles.values():
            middle.close()

        prompt = prompts(3)[2]
        reference = SplitClient.connect(shards / "local", a.url, F32, allow_public_weights=True).generate(
            prompt, max_new_tokens=16, stop_ids=set()
        )
        middle = RemoteMiddle(a.url, local.fingerprint, tuple(split["cloud_layers"]), 64, "float32")
        session = SplitSession(local, middle, F32)
        tokens: list[int] = []

        def emit(token, _logprob):
            tokens.append(token)
            if len(tokens) == 6:  # replica a is drained: the router now sends this key to b
                session.middle.url = b.url
                session.middle._drop()

        decode(session, prompt, session.prefill(prompt), 16, set(), emit, Sequential())
        assert len(b.server.table) == 1
        session.close()
    assert tokens == reference.token_ids
    assert sum(r.recoveries for r in session.records) == 1
