"""telemetry.py: the one summary of a generation's decode steps, as each reader averages it."""

from __future__ import annotations

import statistics

from splitinfer.telemetry import StepRecord, step_summary, summarize


def records() -> list[StepRecord]:
    return [StepRecord("prefill", 12, 0, 9.0, 1.0, 50.0, 30.0, 40.0, 900, 900),
            StepRecord("decode", 4, 2, 2.0, 0.5, 20.0, 10.0, 12.0, 100, 100),
            StepRecord("decode", 4, 1, 4.0, 0.5, 30.0, 12.0, 15.0, 120, 100),
            StepRecord("decode", 4, 3, 3.0, 1.5, 25.0, 11.0, 20.0, 100, 140)]


def test_parts_over_decode_steps_by_any_average():
    steps = [r.as_dict() for r in records()]
    medians = step_summary(steps)
    assert medians == {"round_trip": 25.0, "network": 8.0, "cloud_compute": 11.0, "server_other": 3.0,
                       "local_compute": 3.0, "serialize": 0.5, "step": 29.5, "bytes": 220.0, "accepted": 2.0}
    means = step_summary(steps, ("network", "step"), statistics.fmean)
    assert means == {"network": (8 + 15 + 5) / 3, "step": (22.5 + 34.5 + 29.5) / 3}
    plain = [{k: v for k, v in s.items() if k != "server_ms"} for s in steps]  # a plain split's records
    assert step_summary(plain, ("round_trip", "local_compute")) == {"round_trip": 25.0, "local_compute": 3.0}


def test_a_generation_s_stats_take_the_medians():
    stats = summarize(records(), generated=7, decode_s=0.5, prefill_s=0.05)
    assert stats["median_ms"] == {"round_trip": 25.0, "network": 8.0, "cloud_compute": 11.0, "local_compute": 3.0,
                                  "serialize": 0.5, "step": 29.5}
    assert stats["bytes_per_decode_step"] == 220.0 and stats["steps"] == 3 and stats["prefill_messages"] == 1
