"""Through the real server: concurrent clients batched together get the tokens they get alone."""

from __future__ import annotations

import threading

import pytest
import torch

from splitinfer.cloud.scheduler import BatchConfig
from splitinfer.cloud.server import ServerConfig, ServerThread
from splitinfer.clients import open_client
from splitinfer.local.session import ClientConfig
from splitinfer.model.shards import load_cloud

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
            client = open_client(shards / "local", url, F32, allow_public_weights=True, checks=False)
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
