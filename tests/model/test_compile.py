"""LayerStack.compile_passes: blocks of N+ rows through torch.compile, the same tokens as HF greedy.

`warm_up` compiles two graphs (a block on an empty cache, any other block); after it nothing compiles
again, whatever the block size from two rows and the cache length (dynamic shapes), the cache growing
past its doubling included. Smaller blocks and batches stay eager.
"""

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from splitinfer.clients import open_client
from splitinfer.errors import ModelError
from splitinfer.model.shards import load_cloud, load_local
from tiny import hf_greedy, min_margin, prepare_tiny

PROMPT = [1, 2, 3]  # seed 3: a top-2 margin above 2e-3 over all 300 tokens


def test_compiled_cloud_decodes_hf_greedy_with_no_compile_after_warm_up(tmp_path):
    model, shards = prepare_tiny(tmp_path, "llama", 1, 1, seed=3)
    local, cloud = load_local(shards / "local"), load_cloud(shards / "cloud")
    torch._dynamo.reset()
    counters.clear()
    cloud.stack.compile_passes(2)
    cloud.stack.warm_up(2)
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    counters.clear()
    client = open_client(local_only=True, shards=shards, halves=(local, cloud))
    expected = hf_greedy(model, PROMPT, 300)  # the cache grows past 256 rows: its buffers double once
    assert min_margin(model, PROMPT, expected) > 1e-3
    for strategy in ("sequential", "tree-nohead"):
        got = client.generate(PROMPT, max_new_tokens=300, stop_ids=set(), strategy=strategy)
        assert got.token_ids == expected, strategy
    assert counters["stats"]["unique_graphs"] == 0, dict(counters["stats"])


def test_small_blocks_stay_eager_and_keep_inference_free_buffers(tmp_path):
    _, shards = prepare_tiny(tmp_path, "llama", 1, 1)
    stack = load_cloud(shards / "cloud").stack
    stack.compile_passes(4)
    cache = stack.new_cache()
    hidden = torch.randn(1, 3, stack.config.hidden_size)
    stack(hidden, torch.arange(3), np.tril(np.ones((3, 3), dtype=bool)), cache)
    cache.commit_all()  # keep() runs in inference mode on buffers made outside it
    assert cache.length == 3 and not cache._keys[0].is_inference()


def test_compile_passes_refuses_a_row_count_below_one(tmp_path):
    _, shards = prepare_tiny(tmp_path, "llama", 1, 1)
    with pytest.raises(ModelError, match="at least 1"):
        load_cloud(shards / "cloud").stack.compile_passes(0)
