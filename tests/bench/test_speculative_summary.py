"""bench-spec's summary on hand-made runs: per-prompt and whole-set speed-ups, acceptance statistics."""

from __future__ import annotations

import pytest

from splitinfer.bench.speculative import markdown, summarize


def _run(strategy, prompt, category, accepted, decode_s, generated=None):
    generated = generated if generated is not None else sum(accepted) + 1
    return {
        "strategy": strategy, "rtt_ms": 80.0, "repeat": 0, "prompt_id": prompt, "category": category,
        "tokens_per_s": (generated - 1) / decode_s, "accepted": accepted, "rows": [len(accepted)] * len(accepted),
        "bytes": [1000] * len(accepted), "stats": {"generated_tokens": generated, "decode_s": decode_s},
    }


def test_whole_set_speedup_weights_prompts_by_their_time_and_per_prompt_ratios_do_not():
    runs = [
        _run("sequential", "a", "code", [1] * 100, 10.0),
        _run("sequential", "b", "grounded", [1] * 20, 2.0),
        _run("tree", "a", "code", [1] * 90 + [10], 9.5),  # 100 tokens in 9.5 s: 1.05x
        _run("tree", "b", "grounded", [10, 10], 0.5),  # 20 tokens in 0.5 s: 4x
    ]
    reference = {"a": {"category": "code", "accepted_per_step": 1.5}, "b": {"category": "grounded", "accepted_per_step": 4.5}}
    rows = {r["strategy"]: r for r in summarize(runs, reference)["rows"]}
    tree = rows["tree"]
    assert tree["speedup_vs_sequential_min"] == pytest.approx(10 / 9.5, abs=1e-3)
    assert tree["speedup_vs_sequential_median"] == pytest.approx((10 / 9.5 + 4.0) / 2, abs=1e-3)
    # 120 tokens in 10 s against 120 tokens in 12 s.
    assert tree["speedup_whole_set"] == pytest.approx(1.2, abs=1e-3)
    assert tree["prompt_runs_below_0_95x"] == 0
    assert tree["mean_accepted_per_step"] == pytest.approx((100 / 91 + 10) / 2, abs=1e-3)
    assert tree["mean_accepted_pooled"] == pytest.approx(120 / 93, abs=1e-3)
    assert tree["max_accepted_per_step"] == 10
    assert tree["accepted_histogram"] == {1: 90, 10: 3}
    assert tree["vs_prompt_lookup"] == pytest.approx(tree["mean_accepted_per_step"] / 3.0, abs=1e-3)
    assert rows["sequential"]["speedup_whole_set"] == pytest.approx(1.0)


def test_a_slower_prompt_run_is_counted_below_0_95x_and_shows_in_the_table():
    runs = [
        _run("sequential", "a", "code", [1] * 50, 5.0),
        _run("tree", "a", "code", [1] * 50, 6.0),
    ]
    summary = summarize(runs, {"a": {"category": "code", "accepted_per_step": 1.0}})
    tree = next(r for r in summary["rows"] if r["strategy"] == "tree")
    assert tree["prompt_runs_below_0_95x"] == 1
    report = {"model": "m", "command": "c", "setup": "s", "prompts": ["a"], "max_new_tokens": 50, "repeats": 1,
              "torch": "t", "summary": summary, "divergences": []}
    table = markdown(report)
    assert "| tree | 80 |" in table and "0.833x" in table
