"""`splitinfer bench-batch` runs its cloud-side part on a tiny model and writes consistent JSON + Markdown."""

from __future__ import annotations

import json

from splitinfer.cli import main

from tiny import prepare_tiny


def test_bench_batch_cloud_side(tmp_path):
    _, shards = prepare_tiny(tmp_path, "llama", 1, 1)
    out = tmp_path / "out"
    code = main(["bench-batch", "--shards", str(shards), "--out", str(out), "--sizes", "1,4",
                 "--repeats", "1", "--context", "8", "--clients", "", "--load-clients", ""])
    assert code == 0
    report = json.loads((out / "batching.json").read_text())
    decode = {r["batch"]: r for r in report["cloud"]["rows"] if r["kind"] == "decode"}
    assert sorted(decode) == [1, 4]
    assert all(r["batched_ms"] > 0 and r["one_at_a_time_ms"] > 0 for r in decode.values())
    assert decode[1]["batched_vs_one_step"] == 1.0
    assert report["targets"] == {} and report["e2e"] == []  # no 16-session row, no clients: no target claimed
    assert [r["block_rows"] for r in report["cloud"]["rows"] if r["kind"] == "mixed"] == [[1, 4, 8, 16]]
    assert "| decode | 4 |" in (out / "batching.md").read_text()
