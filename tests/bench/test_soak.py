"""bench soak: the trend rule on made-up series, the report, and a few seconds of a real soak on a tiny model."""

from __future__ import annotations

import json
import os
import random

import pytest

from splitinfer.bench.soak import SoakOptions, run_soak, write_report
from splitinfer.bench.soak_gauges import METRICS, fits, trend


def test_a_flat_noisy_series_does_not_trend_and_a_steady_climb_does():
    rng = random.Random(0)
    times = [float(t) for t in range(120)]
    flat = [500 + rng.gauss(0, 3) for _ in times]
    assert not trend(times, flat, 16.0)["trending"]
    leak = [500 + 0.5 * t + rng.gauss(0, 3) for t in times]  # 60 MiB over two minutes
    fit = trend(times, leak, 16.0)
    assert fit["trending"] and 25 < fit["slope_per_min"] < 35
    small = [500 + 0.05 * t + rng.gauss(0, 0.1) for t in times]  # certain, but 6 MiB: under the tolerance
    assert not trend(times, small, 16.0)["trending"]
    assert not trend([1.0, 2.0], [1.0, 9.0], 0.0)["trending"]  # too few samples to fit


def _samples(grow: float) -> list[dict]:
    return [{"t": float(t), "rss_mib": 400 + grow * t, "fds": 30, "threads": 12, "sessions": t % 3,
             "cached_rows": 100 * (t % 3), "heap_in_use_mib": 300.0, "heap_free_mib": 5 + grow * t,
             "python_blocks": 250_000} for t in range(60)]


def test_the_report_flags_the_growing_resource_of_the_right_process(tmp_path):
    samples = {"api": _samples(0.0), "server 0": _samples(1.0)}
    fitted = fits(samples, warmup_s=10)
    assert fitted["server 0"]["rss_mib"]["trending"]
    assert fitted["server 0"]["heap_free_mib"]["limit"] is None  # memory malloc keeps: reported, never judged
    assert not any(fit["trending"] for name, per in fitted.items() for m, fit in per.items() if (name, m) != ("server 0", "rss_mib"))
    report = {"ok": False, "options": {**SoakOptions().__dict__, "warmup_s": 10}, "servers": [], "errors": [],
              "counts": {"completed": 5, "exact": 5, "abandoned": 1, "failed": 0, "streamed": 3},
              "trending": ["server 0: rss_mib"], "fits": fitted, "samples": samples}
    paths = write_report(report, tmp_path)
    assert json.loads(paths[0].read_text())["trending"] == ["server 0: rss_mib"]
    md = paths[1].read_text()
    assert "FAIL" in md and md.count("**up**") == 1 and "| server 0 | rss_mib |" in md


@pytest.mark.slow  # `splitinfer serve` processes
def test_a_short_soak_with_a_rolling_restart_answers_every_request_exactly(tmp_path):
    from splitinfer.model.prepare import prepare
    from splitinfer.model.source import SourceModel

    from tiny import char_tokenizer, tiny_model

    model = tiny_model("llama", seed=3)
    model.config.eos_token_id = 0
    shards = tmp_path / "tiny-chat"
    prepare(SourceModel("tiny-chat", model.config, model, char_tokenizer()), shards, 2, 2, "float32")
    options = SoakOptions(servers=2, clients=3, duration_s=14, warmup_s=2, max_new_tokens=8, abandon=0.5, prompts=2,
                          restart_every_s=4)
    report = run_soak(shards, options)
    counts = report["counts"]
    print(f"soak: {counts}, restarts {report['restarts']}, trending {report['trending']}")
    assert counts["failed"] == 0 and counts["completed"] > 10 and counts["exact"] == counts["completed"]
    assert counts["abandoned"] >= 1 and counts["streamed"] > counts["abandoned"]
    assert report["restarts"] and all(r["exit_code"] == 0 for r in report["restarts"])  # each drained and exited
    assert set(report["samples"]) == {"api", "server 0", "server 1"}
    # one sample a second, none from a server while it restarts
    assert len(report["samples"]["api"]) >= 12 and all(len(rows) >= 3 for rows in report["samples"].values())
    assert all(set(METRICS) <= set(rows[0]) for rows in report["samples"].values())
    assert all(report["samples"][f"server {i}"][-1]["sessions"] == 0 for i in (0, 1))  # every session closed
    paths = write_report(report, tmp_path / "out")
    assert paths[1].read_text().count("\n| ") == 1 + 3 * len(METRICS)  # the header and a row per process and metric


def test_a_server_that_dies_is_skipped_by_the_sampler_and_fails_the_soak(tmp_path):
    """A dead child not yet waited for (a zombie) has no VmRSS: the sampler skips it instead of dying (the first
    30-minute rerun lost its sampler that way), and a server that exited on its own fails the report."""
    import subprocess
    import sys
    import time

    from splitinfer.bench.soak_gauges import Sampler, proc_stats

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and "Z" not in open(f"/proc/{child.pid}/stat").read().split()[2]:
        time.sleep(0.05)
    with pytest.raises(OSError):
        proc_stats(child.pid)
    with Sampler({"gone": (lambda: child.pid, dict), "api": (os.getpid, dict)}, period_s=0.05) as sampler:
        deadline = time.monotonic() + 20
        while len(sampler.samples["api"]) < 3 and time.monotonic() < deadline:  # three rounds, however long they take
            time.sleep(0.05)
    assert len(sampler.samples["api"]) >= 3 and not sampler.samples["gone"]  # "gone" comes first in every round
    child.wait()
    fitted = fits({"api": _samples(0.0)}, warmup_s=10)
    report = {"ok": False, "options": {**SoakOptions().__dict__, "warmup_s": 10}, "servers": [], "errors": [],
              "counts": {"completed": 5, "exact": 5, "abandoned": 1, "failed": 0, "streamed": 3}, "trending": [],
              "exited": [{"server": 1, "exit_code": -9}], "fits": fitted, "samples": {"api": _samples(0.0)}}
    md = write_report(report, tmp_path)[1].read_text()
    assert "1 servers exited on their own (server 1: exit code -9, see server-1.log)" in md
