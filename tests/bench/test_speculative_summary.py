"""bench-spec's summary on hand-made runs: per-prompt and whole-set speed-ups, acceptance statistics."""

from __future__ import annotations

import pytest

from splitinfer.bench.spec_report import markdown
from splitinfer.bench.spec_summary import summarize
from splitinfer.errors import ConfigError


def _run(strategy, prompt, category, accepted, decode_s, generated=None):
    generated = generated if generated is not None else sum(accepted) + 1
    return {
        "strategy": strategy, "rtt_ms": 80.0, "repeat": 0, "prompt_id": prompt, "category": category,
        "tokens_per_s": (generated - 1) / decode_s, "accepted": accepted, "rows": [len(accepted)] * len(accepted),
        "bytes": [1000] * len(accepted), "stats": {"generated_tokens": generated, "decode_s": decode_s},
        "token_ids": list(range(generated)),
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


def _timed(run, local_ms, cloud_ms, drafting_ms):
    steps = len(run["accepted"])
    run["time_ms"] = {"local": local_ms * steps, "cloud": cloud_ms * steps, "round_trip": 0.0,
                      "drafting": drafting_ms * steps}
    return run


def test_pooled_counts_emitted_tokens_and_the_bound_uses_the_same_steps():
    # 11 emitted tokens after the first in 4 steps, though the last step's path ran past the cap.
    tree = _timed(_run("tree", "a", "code", [3, 3, 3, 9], 1.0, generated=12), 20.0, 50.0, 10.0)
    seq = _timed(_run("sequential", "a", "code", [1] * 11, 2.0), 20.0, 50.0, 0.0)
    local = _timed(_run("local-only", "a", "code", [1] * 11, 0.5), 30.0, 15.0, 0.0)
    local["rtt_ms"] = 0.0
    summary = summarize([seq, tree], {"a": {"category": "code", "accepted_per_step": 1.0}}, [local])
    row = next(r for r in summary["rows"] if r["strategy"] == "tree")
    assert row["mean_accepted_pooled"] == pytest.approx(11 / 4, abs=1e-3)
    assert row["per_category_pooled"] == {"code": pytest.approx(11 / 4, abs=1e-3)}
    # 1000 * 2.75 / (80 + 20 + 50 + 10)
    assert row["bound"]["tokens_per_s"] == pytest.approx(1000 * 2.75 / 160, abs=1e-3)
    assert row["vs_local_only_whole_set"] == pytest.approx(11.0 / 22.0, abs=1e-3)
    assert summary["local_only"]["bound"]["tokens_per_s"] == pytest.approx(1000 / 45, abs=1e-3)
    assert summary["local_only"]["identical_to_split_sequential"] == {"80": "1 of 1"}


def test_results_table_goes_between_the_readme_markers_and_nowhere_else(tmp_path):
    from splitinfer.bench.spec_readme import RESULTS_END, RESULTS_START, replace_results
    from splitinfer.errors import ConfigError

    runs = [_run("sequential", "a", "code", [1] * 10, 2.0), _run("tree", "a", "code", [2] * 5, 1.0)]
    summary = summarize(runs, {"a": {"category": "code", "accepted_per_step": 1.0}})
    report = {"model": "m", "command": "splitinfer bench-spec x", "setup": "s", "prompts": ["a"], "max_new_tokens": 11,
              "repeats": 1, "torch": "t", "summary": summary, "divergences": []}
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\n{RESULTS_START}\nold numbers\n{RESULTS_END}\n\nafter\n")
    replace_results(readme, report, tmp_path / "speculative.md")
    text = readme.read_text()
    assert "old numbers" not in text and text.startswith("# title") and text.endswith("after\n")
    assert "| split, tree | 80 | 10.0 | 2.0x (2.0x) | - | 2.0 (2.0) | - |" in text
    assert "splitinfer bench-spec x" in text
    readme.write_text("no markers")
    with pytest.raises(ConfigError, match="markers"):
        replace_results(readme, report, tmp_path / "speculative.md")


def test_blocks_in_flight_are_reported_against_their_bound():
    # D = 1: 4 steps of 100 ms (L), the cloud the busiest stage at 70 ms (t); D = 2: same tokens in 250 ms,
    # 3 blocks sent ahead used and 1 dropped (p = 0.75).
    one = _timed(_run("tree", "a", "code", [2, 2, 2, 2], 0.4, generated=9), 20.0, 70.0, 10.0)
    two = _timed(_run("tree@D2", "a", "code", [2, 2, 2, 2], 0.25, generated=9), 20.0, 70.0, 10.0)
    two["in_flight"], two["ahead"] = 2, {"sent_ahead_used": 3, "dropped": 1}
    seq = _timed(_run("sequential", "a", "code", [1] * 8, 0.8), 20.0, 50.0, 0.0)
    summary = summarize([seq, one, two], {"a": {"category": "code", "accepted_per_step": 1.0}})
    rows = {r["in_flight"]: r for r in summary["in_flight"]}
    assert set(rows) == {1, 2} and all(r["strategy"] == "tree" for r in rows.values())
    assert (rows[2]["L_ms"], rows[2]["t_ms"], rows[2]["p"], rows[2]["a"]) == (100.0, 70.0, 0.75, 2.0)
    # 1000 * 2 / (0.25 * 100 + 0.75 * max(70, 100 / 2))
    assert rows[2]["bound_tokens_per_s"] == pytest.approx(2000 / 77.5, abs=1e-3)
    assert rows[1]["bound_tokens_per_s"] == pytest.approx(20.0, abs=1e-3) and rows[1]["p"] == 0.0
    assert rows[2]["vs_one_in_flight"] == pytest.approx(0.4 / 0.25, abs=1e-3)
    report = {"model": "m", "command": "c", "setup": "s", "prompts": ["a"], "max_new_tokens": 9, "repeats": 1,
              "torch": "t", "summary": summary, "divergences": []}
    assert "| tree | 80 | 2 | 2.0 | 2.0 | 0.75 | 4 | 0.75 | - | 100.0 | 70.0 | 25.806 |" in markdown(report)


def test_controller_chosen_blocks_in_flight_use_their_mean_depth_and_report_calibration():
    one = _timed(_run("tree", "a", "code", [2, 2, 2, 2], 0.4, generated=9), 20.0, 70.0, 10.0)
    auto = _timed(_run("tree@Dauto", "a", "code", [2, 2, 2, 2], 0.3, generated=9), 20.0, 70.0, 10.0)
    # 2 of 4 blocks went ahead and held, one at depth 2 and one at depth 3; none dropped; 4 assumptions checked,
    # given 0.4 each on average, 2 held
    auto["in_flight"], auto["ahead"] = 0, {"sent_ahead_used": 2, "dropped": 0, "depth_sum": 5, "checked": 4,
                                           "held": 2, "p_sum": 1.6}
    seq = _timed(_run("sequential", "a", "code", [1] * 8, 0.8), 20.0, 50.0, 0.0)
    summary = summarize([seq, one, auto], {"a": {"category": "code", "accepted_per_step": 1.0}})
    row = next(r for r in summary["in_flight"] if r["in_flight"] == 0)
    assert (row["p"], row["depth"], row["hold"], row["score"], row["held"]) == (0.5, 2.5, 1.0, 0.4, 0.5)
    # 1000 * 2 / (0.5 * 100 + 0.5 * max(70, 100 / 2.5))
    assert row["bound_tokens_per_s"] == pytest.approx(2000 / 85, abs=1e-3)
    assert row["vs_one_in_flight_min"] == pytest.approx(0.4 / 0.3, abs=1e-3)
    report = {"model": "m", "command": "c", "setup": "s", "prompts": ["a"], "max_new_tokens": 9, "repeats": 1,
              "torch": "t", "summary": summary, "divergences": []}
    assert "| tree | 80 | auto | 2.5 | 2.0 | 0.5 | 2 | 1.0 | 0.4 / 0.5 | 100.0 | 70.0 | 23.529 |" in markdown(report)


def test_step_cost_curve_is_the_median_step_per_bucket_of_rows_per_round_trip():
    seq = _run("sequential", "a", "code", [1] * 3, 1.0)
    seq["rows"], seq["step_ms"] = [1, 1, 1], [100.0, 104.0, 300.0]  # one slow step: the median ignores it
    tree = _run("tree", "a", "code", [1, 2, 3, 1], 1.0)
    tree["rows"], tree["step_ms"] = [2, 5, 6, 16], [120.0, 170.0, 180.0, 200.0]
    summary = summarize([seq, tree], {"a": {"category": "code", "accepted_per_step": 1.0}})
    assert summary["step_cost"] == {"80": {1: {"median_ms": 104.0, "steps": 3}, 2: {"median_ms": 120.0, "steps": 1},
                                           6: {"median_ms": 175.0, "steps": 2}, 16: {"median_ms": 200.0, "steps": 1}}}
    report = {"model": "m", "command": "c", "setup": "s", "prompts": ["a"], "max_new_tokens": 4, "repeats": 1,
              "torch": "t", "summary": summary, "divergences": []}
    table = markdown(report)
    assert "| added RTT ms | 1 | 2 | 5-6 | 13-16 |" in table and "| 80 | 104.0 (3) | 120.0 (1) | 175.0 (2) | 200.0 (1) |" in table


def test_the_heads_share_is_pooled_over_steps_and_shown_by_category():
    code = _run("tree", "a", "code", [2] * 10, 1.0)
    chat = _run("tree", "b", "conversational", [1] * 30, 1.0)
    code["stats"]["draft_head"] = {"steps": 10, "rows": 20, "tokens": 5, "ms": 100.0}
    chat["stats"]["draft_head"] = {"steps": 5, "rows": 10, "tokens": 1, "ms": 50.0}
    seq = [_run("sequential", p, c, [1] * n, 2.0) for p, c, n in (("a", "code", 20), ("b", "conversational", 30))]
    reference = {"a": {"category": "code", "accepted_per_step": 1.0}, "b": {"category": "conversational", "accepted_per_step": 1.0}}
    summary = summarize(seq + [code, chat], reference)
    rows = {r["strategy"]: r for r in summary["rows"]}
    assert rows["sequential"]["draft_head"] is None
    head = rows["tree"]["draft_head"]
    assert head["drafting_share"] == pytest.approx(15 / 40, abs=1e-3)
    assert head["tokens_per_drafting_step"] == pytest.approx(6 / 15, abs=1e-3)
    assert head["rows_per_drafting_step"] == 2.0 and head["ms_per_drafting_step"] == 10.0
    assert head["tokens_per_step"] == pytest.approx(6 / 40, abs=1e-3)
    assert head["tokens_per_step_by_category"] == {"code": 0.5, "conversational": pytest.approx(1 / 30, abs=1e-3)}
    report = {"model": "m", "command": "c", "setup": "s", "prompts": ["a", "b"], "max_new_tokens": 30, "repeats": 1,
              "torch": "t", "summary": summary, "divergences": []}
    assert "| tree | 80 | 0.375 | 2.0 | 0.4 | 10.0 | 0.15 | 0.5 | 0.033 |" in markdown(report)


def test_padding_settings_are_parsed_named_and_refused_when_malformed():
    from types import SimpleNamespace

    from splitinfer.bench.speculative import label, pad_settings
    from splitinfer.wire.padding import PadSetting

    settings = pad_settings(SimpleNamespace(pad_rows="33,33+s64,33+s64+h110+t50"))
    assert [s.key for s in settings] == ["0", "33", "33+s64", "33+s64+h110+t50"]
    assert settings[3] == PadSetting(33, 64, 110, 50)
    assert [label("tree", 1, s) for s in settings] == ["tree", "tree+pad33", "tree+pad33+s64", "tree+pad33+s64+h110+t50"]
    assert label("tree", 2, settings[2]) == "tree+pad33+s64@D2"
    for bad in ("x", "33+q4", "0+s64", "33+s"):
        with pytest.raises(ConfigError, match="--pad-rows"):
            pad_settings(SimpleNamespace(pad_rows=bad))


def test_the_padding_legend_shows_only_when_a_configuration_is_padded():
    from splitinfer.bench.spec_report import _padding_lines

    assert _padding_lines({"pad_rows": ["0"]}) == [] and _padding_lines({}) == []
    assert _padding_lines({"pad_rows": ["0", "33+s64"]})[0].startswith("Padded configurations")


def test_rtt_efficiency_is_network_time_over_step_time():
    from splitinfer.bench.spec_summary import rtt_efficiency

    runs = [{"time_ms": {"local": 20.0, "cloud": 30.0, "round_trip": 110.0, "drafting": 10.0}},
            {"time_ms": {"local": 20.0, "cloud": 30.0, "round_trip": 110.0, "drafting": 10.0}}]
    # network 2 x (110 - 30) = 160 of a step time 2 x (20 + 110 + 10) = 280
    assert rtt_efficiency(runs) == round(160 / 280, 3)
    assert rtt_efficiency([{"time_ms": {"local": 0.0, "cloud": 0.0, "round_trip": 80.0, "drafting": 0.0}}]) == 1.0
    assert rtt_efficiency([{"stats": {}}]) is None
