"""bench/devicestep.py and bench/splitcheck.py (the GPU check's own measurements), on the CPU: the cloud step's
eager path on a prefilled cache leaves the cache as it found it and computes what a server step computes; the
split check's comparison finds the first different token."""

import json

import numpy as np
import torch

from splitinfer.bench import devicestep
from splitinfer.bench.splitcheck import compare
from splitinfer.model.shards import load_cloud
from splitinfer.model.synthetic import prepare_synthetic
from tiny import COMMON


def test_the_eager_cloud_step_on_a_synthetic_shard(tmp_path):
    config = tmp_path / "cfg.json"
    config.write_text(json.dumps({"model_type": "mistral", **COMMON, "sliding_window": 12}))
    shards = prepare_synthetic(str(config), tmp_path / "s", seed=0, sides=("cloud",), dtype="float32")
    stack = load_cloud(shards / "cloud").stack
    result = devicestep.measure(stack, [1, 3], [5, 20], repeats=2, log=lambda _: None, hop=True)
    assert [(r["context"], r["rows"]) for r in result["rows"]] == [(5, 1), (5, 3), (20, 1), (20, 3)]
    # The thread hop is timed on one-row blocks only, each path unpinned and pinned.
    assert [sorted(r["hop"]) for r in result["rows"] if r["rows"] == 1] == [sorted(
        f"{where}_{path}_ms" for where in ("unpinned", "pinned") for path in ("direct", "executor"))] * 2
    assert all("hop" not in r for r in result["rows"] if r["rows"] == 3)
    assert all(r["eager_ms"] > 0 and r["bound_ms"] > 0 and r["graph_ms"] is None for r in result["rows"])
    # serve's graphs, uncaptured on a CPU: the eager step's output (the window of 12 inside the span's mask)
    assert all(r["serve_graphs"] == "static" and r["serve_graph_max_abs_diff"] < 1e-5 for r in result["rows"])
    assert stack.graphs is None
    # A block's output is the stack's own on the same cache, and the cache keeps its length (each block truncated).
    cache = devicestep.prefill(stack, 20, torch.Generator().manual_seed(1))
    block = devicestep.Block(stack, cache, 20, 3, torch.Generator().manual_seed(2))
    out = block.eager()
    assert cache.length == 20 and cache.pending == 0
    reference = stack(block.hidden, torch.arange(20, 23), np.tril(np.ones((3, 3), dtype=bool)), cache)
    torch.testing.assert_close(out, reference)  # the window of 12 is in the mask: both built it the same way


def test_compare_names_the_first_different_token():
    runs = [{"strategy": "sequential", "prompt": 0, "token_ids": [1, 2, 3]},
            {"strategy": "tree-nohead", "prompt": 0, "token_ids": [1, 2, 3]},
            {"strategy": "sequential", "prompt": 1, "token_ids": [4, 5, 6]},
            {"strategy": "tree-nohead", "prompt": 1, "token_ids": [4, 7, 6]},
            {"strategy": "jacobi", "prompt": 1, "token_ids": [4, 5]}]
    assert [(c["identical"], c["first_different_token"]) for c in compare(runs)] == [(True, None), (False, 1), (False, 2)]
