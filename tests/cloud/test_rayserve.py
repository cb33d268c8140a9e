"""`serve --ray`: two replicas on a local Ray cluster, eight concurrent sessions, one replica killed
mid-generation; every output equals its solo run. Run by `make test-ray` (needs the ray extra)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from splitinfer.cloud.rayserve import ReplicaDirectory, desired_replicas, kv_autoscaling_policy
from splitinfer.decoding.loop import decode
from splitinfer.decoding.strategies import Sequential
from splitinfer.launch import free_port
from splitinfer.clients import open_client
from splitinfer.local.failover import fetch_replicas
from splitinfer.local.session import ClientConfig, SplitSession

from clock import FakeClock
from tiny import prepare_tiny

PROMPTS = [[3 + i, 17, 42, 5 + i, 88, 21, 9, 60 + i, 33, 7] for i in range(8)]
NEW_TOKENS = 24
F32 = ClientConfig(wire_dtype="float32", prefill_chunk=8, retry_backoff_s=0.1, max_retries=8)


def test_kv_policy_follows_reserved_bytes_and_refusals():
    assert desired_replicas([0.9, 0.9], 0, current=2, target=0.7) == 3
    assert desired_replicas([0.1, 0.1], 0, current=2, target=0.7) == 1
    assert desired_replicas([0.1, 0.1], 2, current=2, target=0.7) == 3  # refusals: one more, whatever the bytes
    ctx = SimpleNamespace(aggregated_metrics={"kv_reserved_share": {"a": 0.95, "b": 0.95}, "refusals": {"a": 0, "b": 0}},
                          current_num_replicas=2, capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=4,
                          policy_state={})
    assert kv_autoscaling_policy(ctx)[0] == 3
    ctx.capacity_adjusted_max_replicas = 2
    assert kv_autoscaling_policy(ctx)[0] == 2


def test_the_directory_lists_replicas_that_reported_recently():
    clock = FakeClock()
    directory = ReplicaDirectory(ttl_s=15, clock=clock)
    assert directory.report("ws://b:1") == ["ws://b:1"]
    clock.advance(10)
    assert directory.report("ws://a:1") == ["ws://a:1", "ws://b:1"]
    clock.advance(5)  # b reported 15 s ago: still within the TTL
    assert directory.urls() == ["ws://a:1", "ws://b:1"]
    clock.advance(1)
    assert directory.report("ws://a:1") == ["ws://a:1"]  # b stopped reporting: it drops out


@pytest.mark.ray
def test_two_replicas_eight_sessions_one_replica_killed(tmp_path, settle):
    pytest.importorskip("ray")
    import ray

    from splitinfer.cloud import rayserve
    from splitinfer.cloud.server import ServerConfig

    model, shards = prepare_tiny(tmp_path, "llama", 2, 2)
    expected = [
        model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                       pad_token_id=0)[0, len(p):].tolist()
        for p in PROMPTS
    ]
    ray.init(num_cpus=4, include_dashboard=False)
    try:
        urls = rayserve.deploy(str(shards / "cloud"), ServerConfig(port=free_port()),
                               rayserve.RayConfig(replicas=2, cpus_per_replica=1), threads=1)
        assert len(urls) == 2
        # Each replica lists the deployment (GET /replicas) once both reported at a health check.
        assert settle(lambda: all(fetch_replicas(url) == urls for url in urls), 30)
        client = open_client(shards / "local", urls, F32, allow_public_weights=True, checks=False)
        local = client.local
        halfway = threading.Barrier(len(PROMPTS) + 1)
        killed = threading.Event()
        outputs: list[list[int] | BaseException] = [[] for _ in PROMPTS]
        middles = [client.make_middle() for _ in PROMPTS]
        while {m.url for m in middles} != set(urls):  # random keys: make sure both replicas get sessions
            middles = [client.make_middle() for _ in PROMPTS]

        def run(i):
            try:
                session = SplitSession(local, middles[i], F32)
                tokens = outputs[i]

                def emit(token, _logprob):
                    tokens.append(token)
                    if len(tokens) == 6:
                        halfway.wait(timeout=120)
                        killed.wait(timeout=120)

                decode(session, PROMPTS[i], session.prefill(PROMPTS[i]), NEW_TOKENS, set(), emit, Sequential())
                session.close()
            except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
                outputs[i] = exc

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        halfway.wait(timeout=180)  # every session is mid-generation
        actors = rayserve.replica_actors()
        assert len(actors) == 2
        ray.kill(actors[0], no_restart=False)
        killed.set()
        for t in threads:
            t.join(timeout=300)
        assert outputs == expected
        assert sum(m.failovers for m in middles) >= 1
    finally:
        rayserve.shutdown()
