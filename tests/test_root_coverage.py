"""scripts/root_coverage.py (the lab script behind notes/bench/inflight/roots1-fastcloud80/coverage.md) runs on a
tiny model: it replays each prompt's first generation once and counts hits that can only grow with k."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tiny import hf_greedy, tiny_model

SCRIPT = Path(__file__).parents[1] / "scripts" / "root_coverage.py"


def _load():
    spec = importlib.util.spec_from_file_location("root_coverage", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_root_coverage_replays_each_prompt_once_and_counts_more_hits_with_more_roots():
    script = _load()
    model = tiny_model("llama")
    prompt = [5, 9, 11, 2, 5, 9, 11, 2, 5, 9]
    out = hf_greedy(model, prompt, 12)
    run = {"prompt_id": "a", "prompt_token_ids": prompt, "token_ids": out}
    result = script.coverage([run, dict(run)], model, ks=(1, 4, 16))  # the second run of "a" is not replayed
    assert result["tokens"] == len(out) - 1 and result["prompts"] == 1
    rates = [row["hit_rate"] for row in result["rows"]]
    assert rates == sorted(rates) and all(0.0 <= r <= 1.0 for r in rates)
    assert [row["k"] for row in result["rows"]] == [1, 4, 16]
