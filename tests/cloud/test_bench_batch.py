"""`splitinfer bench batch` runs its cloud-side part on a tiny model and writes consistent JSON + Markdown."""

from __future__ import annotations

import json

import pytest

from splitinfer.bench.lone import markdown as lone_markdown
from splitinfer.cli import main

from tiny import prepare_tiny


def test_lone_markdown_says_whether_the_target_is_met():
    lone = {"samples": 20, "direct_ms": 2.0, "via_scheduler_ms": 2.3, "via_executor_ms": 2.1,
            "scheduler_minus_executor_ms": 0.2, "scheduler_vs_direct": 1.15}
    text = "\n".join(lone_markdown(lone))
    assert "**1.15x** (not met)" in text and "loopback" not in text
    text = "\n".join(lone_markdown({**lone, "scheduler_vs_direct": 1.1, "via_server_ms": 2.6, "server_vs_direct": 1.3}))
    assert "**1.1x** (met)" in text and "2.6 ms, 1.3x direct" in text


def test_bench_batch_cloud_side(tmp_path):
    _, shards = prepare_tiny(tmp_path, "llama", 1, 1)
    out = tmp_path / "out"
    code = main(["bench", "batch", "--shards", str(shards), "--out", str(out), "--sizes", "1,4",
                 "--repeats", "1", "--context", "8", "--clients", "", "--load-clients", ""])
    assert code == 0
    report = json.loads((out / "batching.json").read_text())
    decode = {r["batch"]: r for r in report["cloud"]["rows"] if r["kind"] == "decode"}
    assert sorted(decode) == [1, 4]
    assert all(r["batched_ms"] > 0 and r["one_at_a_time_ms"] > 0 for r in decode.values())
    # The derived columns are what their names say, recomputed from the two measured medians of each row;
    # the reference step is the batch-1 decode row's batched time.
    one_step = decode[1]["batched_ms"]
    for r in report["cloud"]["rows"]:
        assert r["batched_vs_one_step"] == round(r["batched_ms"] / one_step, 3), r
        assert r["speedup_vs_one_at_a_time"] == round(r["one_at_a_time_ms"] / r["batched_ms"], 3), r
        assert r["steps_per_s_batched"] == round(r["batch"] / r["batched_ms"] * 1e3, 1), r
        assert r["steps_per_s_one_at_a_time"] == round(r["batch"] / r["one_at_a_time_ms"] * 1e3, 1), r
    assert report["targets"] == {} and report["e2e"] == []  # no 16-session row, no clients: no target claimed
    assert [r["block_rows"] for r in report["cloud"]["rows"] if r["kind"] == "mixed"] == [[1, 4, 8, 16]]
    lone = report["cloud"]["lone_session"]  # bench/lone.py: every path timed, the ratios to direct
    assert all(lone[key] > 0 for key in ("direct_ms", "via_scheduler_ms", "via_executor_ms", "via_server_ms",
                                         "scheduler_vs_direct", "server_vs_direct"))
    assert lone["server_window_waits"] is not None and lone["samples"] == 20
    met = "met" if lone["scheduler_vs_direct"] <= 1.1 else "not met"
    assert f"**{lone['scheduler_vs_direct']}x** ({met})" in (out / "batching.md").read_text()
    four = decode[4]
    row = (f"| decode | 4 | 1 x 4 | 1 | {four['batched_ms']} | {four['one_at_a_time_ms']} | "
           f"{four['batched_vs_one_step']} | {four['speedup_vs_one_at_a_time']} |")
    assert row in (out / "batching.md").read_text()


@pytest.mark.slow
def test_clients_end_to_end_on_a_synthetic_shard(tmp_path):
    """A synthetic shard has no tokenizer: its clients draw seeded token ids and the run completes."""
    from splitinfer.model.synthetic import prepare_synthetic
    from tiny import COMMON

    config = tmp_path / "cfg.json"
    config.write_text(json.dumps({"model_type": "llama", **COMMON}))
    shards = prepare_synthetic(str(config), tmp_path / "s", seed=0, head_layers=1, tail_layers=1)
    out = tmp_path / "out"
    assert main(["bench", "batch", "--shards", str(shards), "--out", str(out), "--sizes", "1", "--repeats", "1",
                 "--context", "8", "--clients", "1", "--load-clients", "", "--rtt-ms", "5", "--max-new-tokens", "4"]) == 0
    e2e = json.loads((out / "batching.json").read_text())["e2e"]
    assert [r["clients"] for r in e2e] == [1, 1] and all(r["generated_tokens"] == 4 for r in e2e)
