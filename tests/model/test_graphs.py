"""LayerStack.use_graphs: lone blocks padded to a bucket of rows, attending over the whole key buffer, written at
static slots (model/graphs.py). No GPU here, so the static pass runs without capture: the same shapes, inputs
and cache writes a CUDA graph replays. These tests hold its logic: HF greedy tokens through it, outputs and
cache rows against the eager pass (float32: within rounding; the buffers' growth included), one setup per
(bucket, span) and per cache, and the blocks that stay eager."""

import numpy as np
import pytest
import torch

from splitinfer.clients import open_client
from splitinfer.errors import ModelError
from splitinfer.model.graphs import BUCKETS, bucket
from splitinfer.model.shards import load_cloud, load_local
from tiny import hf_greedy, min_margin, prepare_tiny

PROMPT = [1, 2, 3]


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gemma3"])  # gemma3: windows of 6 beside global
def test_graphed_cloud_decodes_hf_greedy(tmp_path, family):
    model, shards = prepare_tiny(tmp_path, family, 1, 1, seed=3)
    local, cloud = load_local(shards / "local"), load_cloud(shards / "cloud")
    cloud.stack.use_graphs(capture=False)
    client = open_client(local_only=True, shards=shards, halves=(local, cloud))
    expected = hf_greedy(model, PROMPT, 300)  # past 256 cached rows: the buffers double once
    margin = min_margin(model, PROMPT, expected)
    assert margin > 1e-4, margin
    for strategy in ("sequential", "tree-nohead"):
        got = client.generate(PROMPT, max_new_tokens=300, stop_ids=set(), strategy=strategy)
        assert got.token_ids == expected, strategy
    stats = cloud.stack.graphs.stats()
    assert stats["replayed"] > stats["captured"] > 0, stats


def blocks(generator):
    """A prefill, tree-shaped blocks with rejected rows, then single rows: (rows, allowed, keep)."""
    yield 5, np.tril(np.ones((5, 5), dtype=bool)), range(5)
    tree = np.eye(4, dtype=bool)
    tree[1:, 0] = True
    tree[3, 1] = True  # rows 1 and 2 branch off row 0; row 3 follows row 1
    for _ in range(60):
        yield 4, tree, [0, 1, 3]
        yield 1, np.ones((1, 1), dtype=bool), [0]
    for rows in (17, 33, 64):
        yield rows, np.tril(np.ones((rows, rows), dtype=bool)), range(rows // 2)


def test_static_pass_matches_eager_outputs_and_cache(tmp_path):
    _, shards = prepare_tiny(tmp_path, "llama", 1, 1)
    eager, graphed = load_cloud(shards / "cloud").stack, load_cloud(shards / "cloud").stack
    graphed.use_graphs(capture=False)
    caches = eager.new_cache(), graphed.new_cache()
    generator = torch.Generator().manual_seed(0)
    for rows, allowed, keep in blocks(generator):
        hidden = torch.randn(1, rows, eager.config.hidden_size, generator=generator)
        positions = torch.arange(caches[0].length, caches[0].length + rows)
        want = eager(hidden, positions, allowed, caches[0])
        got = graphed(hidden, positions, allowed, caches[1])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert caches[1].pending == rows
        for cache in caches:
            cache.keep(keep)
    assert caches[0].length == caches[1].length > 256  # past the first doubling
    length = caches[0].length
    for mine, theirs in zip(caches[1]._keys + caches[1]._values, caches[0]._keys + caches[0]._values):
        torch.testing.assert_close(mine[:, :, :length], theirs[:, :, :length], rtol=1e-5, atol=1e-5)
    # a setup per (bucket, span) a cache met: buckets 8 (5 rows), 4, 1, 32 (17), 64 (33 and 64) at its spans
    assert graphed.graphs.captured <= 2 * len(BUCKETS), graphed.graphs.stats()


def test_one_setup_per_bucket_and_span_and_per_cache(tmp_path):
    _, shards = prepare_tiny(tmp_path, "llama", 1, 1)
    stack = load_cloud(shards / "cloud").stack
    stack.use_graphs(capture=False)
    chain = np.ones((1, 1), dtype=bool)
    for cache in (stack.new_cache(), stack.new_cache()):
        for step in range(10):
            stack(torch.randn(1, 1, stack.config.hidden_size), torch.tensor([step]), chain, cache)
            cache.commit_all()
    assert stack.graphs.stats() == {"captured": 2, "replayed": 20, "capture": False}


def test_large_blocks_held_blocks_and_batches_stay_eager(tmp_path):
    _, shards = prepare_tiny(tmp_path, "llama", 1, 1)
    stack = load_cloud(shards / "cloud").stack
    stack.use_graphs(capture=False)
    cache = stack.new_cache()
    rows = BUCKETS[-1] + 1
    stack(torch.randn(1, rows, stack.config.hidden_size), torch.arange(rows), np.tril(np.ones((rows, rows), bool)),
          cache)
    cache.hold()
    assert not stack.graphs.fits(torch.zeros(1, 1, 8), cache)  # a held block: the prefix mask path
    assert not stack.graphs.fits(torch.zeros(2, 1, 8), stack.new_cache())  # a batch of sessions
    assert stack.graphs.stats()["captured"] == 0


def test_buckets():
    assert [bucket(q) for q in (1, 2, 3, 5, 9, 16, 17, 64)] == [1, 2, 4, 8, 16, 16, 32, 64]


def test_capture_needs_a_cuda_device(tmp_path):
    _, shards = prepare_tiny(tmp_path, "llama", 1, 1)
    with pytest.raises(ModelError, match="one CUDA device"):
        load_cloud(shards / "cloud").stack.use_graphs(capture=True)


def test_a_failed_capture_runs_the_step_eager_and_every_later_one(tmp_path, monkeypatch):
    _, shards = prepare_tiny(tmp_path, "llama", 1, 1)
    eager, graphed = load_cloud(shards / "cloud").stack, load_cloud(shards / "cloud").stack
    graphed.use_graphs(capture=False)

    def fails(*_):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphed.graphs, "_prepare", fails)
    caches = eager.new_cache(), graphed.new_cache()
    chain = np.ones((1, 1), dtype=bool)
    for step in range(3):
        hidden = torch.randn(1, 1, eager.config.hidden_size)
        outs = [stack(hidden, torch.tensor([step]), chain, cache) for stack, cache in zip((eager, graphed), caches)]
        assert torch.equal(outs[0], outs[1]) and caches[1].pending == 1
        for cache in caches:
            cache.commit_all()
    assert not graphed.graphs.eligible and graphed.graphs.stats()["captured"] == 0
