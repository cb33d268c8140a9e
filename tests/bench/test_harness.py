"""bench/harness.py: the timing loop on a fake clock (warm-up dropped, the order turned or shuffled, medians and
paired ratios) and the writer's two files (the command, the provenance, the record and the body)."""

from __future__ import annotations

import argparse
import json
import random

import pytest

from splitinfer.bench import harness


class FakeClock:
    """A clock that moves only when a call says it took time."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def spend(self, seconds: float) -> None:
        self.now += seconds


def test_timed_drops_the_warm_up_and_returns_each_repeat():
    clock, durations = FakeClock(), iter([9.0, 9.0, 1.0, 3.0, 2.0])  # two warm-up calls, then three timed
    calls = []

    def call():
        calls.append(1)
        clock.spend(next(durations))

    assert harness.timed(call, 3, warmup=2, clock=clock) == [1.0, 3.0, 2.0]
    assert len(calls) == 5


def test_rounds_turn_the_order_drop_the_warm_up_rounds_and_check_each_round():
    clock, order, checked, flushed = FakeClock(), [], [], []
    cost = {"a": 0.002, "b": 0.004}

    def call(name):
        def run():
            order.append(name)
            clock.spend(cost[name])
            cost[name] += 0.001 if len(order) <= 2 else 0.0  # the warm-up round is slower: it must not count
            return name.upper()
        return run

    times = harness.rounds({"a": call("a"), "b": call("b")}, 3, warmup=1, clock=clock,
                           before=lambda: flushed.append(1), check=checked.append)
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]  # A B, B A, ...: drift falls on both alike
    assert times == {"a": [pytest.approx(0.003)] * 3, "b": [pytest.approx(0.005)] * 3}
    assert len(flushed) == 8 and checked == [{"a": "A", "b": "B"}] * 4
    assert harness.median_ms(times["a"]) == 3.0
    assert harness.paired_ratio(times["b"], times["a"]) == pytest.approx(5 / 3, abs=1e-3)


def test_rounds_shuffle_with_the_generator_they_are_given():
    seen = []
    calls = {name: (lambda name=name: seen.append(name)) for name in "abcd"}
    harness.rounds(calls, 2, shuffle=random.Random(0))
    names, expected = list("abcd"), []
    rng = random.Random(0)
    for _ in range(3):
        rng.shuffle(names)
        expected += names
    assert seen == expected


def test_the_median_is_the_middle_round_not_the_mean():
    clock, durations = FakeClock(), iter([5.0, 0.001, 0.002, 0.9, 0.003, 0.004])
    times = harness.rounds({"x": lambda: clock.spend(next(durations))}, 5, clock=clock)
    assert harness.median_ms(times["x"]) == 3.0  # the 0.9 s outlier moves the mean, not the median


def test_the_writer_stores_the_record_under_its_command_and_provenance(tmp_path):
    args = argparse.Namespace(argv=["bench", "wan", "--out", "a dir", "--rtt-ms", "80"])
    command = harness.command_line(args)
    assert command == "splitinfer bench wan --out 'a dir' --rtt-ms 80"
    logged = []
    text = harness.write(tmp_path / "out", "wan", {"rows": [[1, 2]]}, ["| a |", "|---|", "| 1 |"],
                         title="A title", command=command, log=logged.append)
    saved = json.loads((tmp_path / "out" / "wan.json").read_text())
    assert saved["command"] == command and saved["rows"] == [[1, 2]]
    p = saved["provenance"]
    assert {"splitinfer", "commit", "torch", "python", "platform", "cpu_flags", "threads", "cores"} <= set(p)
    assert p["threads"] >= 1 and isinstance(p["cpu_flags"], list)
    md = (tmp_path / "out" / "wan.md").read_text()
    assert md == text and logged == [text]
    lines = md.splitlines()
    assert lines[0] == "# A title" and lines[2] == f"Command: `{command}`"
    assert lines[4].startswith(f"splitinfer {p['splitinfer']} at ") and f"torch {p['torch']}" in lines[4]
    assert lines[-3:] == ["| a |", "|---|", "| 1 |"]
