"""From raw runs to the report: medians, fits, break-even, checks, Markdown and plots (synthetic runs)."""

from __future__ import annotations

import pytest

from splitinfer.bench import report, summary

RTTS = [0.0, 20.0, 40.0, 80.0, 150.0]
TRUTH = {"split-sequential": (1.0, 90.0), "split-tree": (2.0, 140.0)}


def _run(mode, rtt, a, f, repeat, prompt, tokens=(1, 2, 3), extra_ms=0.0):
    step = rtt + f + extra_ms  # extra_ms: wall time the telemetry does not see
    return {
        "mode": mode, "rtt_ms": rtt, "repeat": repeat, "prompt_id": prompt, "category": prompt.split("-")[0],
        "token_ids": list(tokens), "tokens_per_s": 1000 * a / step, "generated": 33, "steps": 32 / a,
        "accepted_per_step": a, "bytes_per_step": 2565.0 * a, "network_ms": rtt + 1.0, "cloud_compute_ms": f * 0.6,
        "server_other_ms": 0.5, "local_compute_ms": f * 0.4 - 1.5, "serialize_ms": 0.5, "step_ms": rtt + f,
        "between_steps_ms": 0.2, "prefill_ms": 100.0,
    }


def _runs(seq_extra_ms=0.0):
    runs = []
    for rep in range(3):
        for prompt in ("code-1", "chat-1"):
            runs.append(_run("local-only", 0.0, 1.0, 85.0, rep, prompt))
            for rtt in RTTS:
                runs.append(_run("split-sequential", rtt, *TRUTH["split-sequential"], rep, prompt, extra_ms=seq_extra_ms))
                runs.append(_run("split-tree", rtt, *TRUTH["split-tree"], rep, prompt, tokens=(1, 2, 4)))
    return runs


def _raw(runs, probe_offset=1.0):
    return {"runs": runs, "probe_rtt_ms": {f"{r:g}": [r + probe_offset] * 5 for r in RTTS}}


def test_rows_fits_and_checks_on_runs_that_follow_the_model():
    s = summary.summarize(_raw(_runs()), price_per_hour=3.6, projection_rtts=[10.0, 80.0, 300.0])
    seq = next(r for r in s["rows"] if r["mode"] == "split-sequential" and r["rtt_ms"] == 80.0)
    assert seq["tokens_per_s"] == pytest.approx(1000 / 170, abs=1e-3)
    assert seq["usd_per_million_tokens"] == pytest.approx(1000 / seq["tokens_per_s"], rel=1e-3)
    assert seq["identical_to_local_only"] == 6
    tree = next(r for r in s["rows"] if r["mode"] == "split-tree" and r["rtt_ms"] == 0.0)
    assert tree["identical_to_local_only"] == 0 and tree["accepted_per_step"] == 2.0
    for mode, (a, f) in TRUTH.items():
        assert s["model"][mode]["a"] == pytest.approx(a, rel=1e-3)
        assert s["model"][mode]["f_ms"] == pytest.approx(f, rel=1e-3)
    assert s["model"]["local-only"]["fitted"] is False
    assert [p["rtt_ms"] for p in s["projection"]] == [10.0, 300.0]  # 80 was swept
    b = next(x for x in s["break_even"] if x["rtt_ms"] == 80.0)
    assert b["break_even_a"] == pytest.approx(220 / 170, rel=1e-3) and b["pays"] is True
    assert [c["passed"] for c in s["checks"]] == [True] * 5  # the fit, then probes at 20, 40, 80, 150


def test_checks_fail_when_the_measurements_disagree():
    # 15 ms per step the telemetry does not see (17% of f), and a probe 5 ms slow at every RTT
    s = summary.summarize(_raw(_runs(seq_extra_ms=15.0), probe_offset=5.0), price_per_hour=2.0, projection_rtts=[])
    fit_check, *probe_checks = s["checks"]
    assert fit_check["passed"] is False and fit_check["measured"] == pytest.approx(105.0, rel=1e-3)
    assert [c["passed"] for c in probe_checks] == [False, False, True, True]  # 5 ms is >10% of 20 and 40 only


def test_markdown_and_plots(tmp_path):
    s = summary.summarize(_raw(_runs()), price_per_hour=2.0, projection_rtts=[300.0])
    prefill = {"rtt_ms": 40.0, "bandwidth_mbit": 100.0, "chunk_rows": 512, "results": [
        {"tokens": 1024, "kind": "wire", "chunks": 2, "total_ms": 300.0, "bytes_up": 1_180_000, "bytes_down": 1_180_000,
         "sequential_floor_ms": 268.8, "link_floor_ms": 134.4, "vs_link_floor": 2.23, "vs_sequential_floor": 1.12,
         "trace": [{"rows": 512, "bytes_up": 590_000, "bytes_down": 590_000, "start_ms": 0.0, "end_ms": 150.0},
                   {"rows": 512, "bytes_up": 590_000, "bytes_down": 590_000, "start_ms": 150.0, "end_ms": 300.0}]}]}
    data = {"model": "M", "command": "splitinfer bench --quick", "setup": "S", "prompts": ["code-1", "chat-1"],
            "config": {"max_new_tokens": 16, "repeats": 3}, "torch": "2", "machine": {"cpus": 2}, "elapsed_s": 1.0,
            "summary": s, "prefill": prefill}
    data["plots"] = report.plot(data, tmp_path)
    assert data["plots"] == list(report.PLOTS)
    for name in report.PLOTS:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = report.markdown(data)
    assert "PASS: fitted f of split-sequential" in md
    assert "| split-tree | 80 | 9.091 |" in md
    assert "![breakdown.png](breakdown.png)" in md
    assert "| 1024 | wire | 2 |" in md


def test_docs_section_is_the_report(tmp_path):
    from splitinfer.errors import ConfigError

    s = summary.summarize(_raw(_runs()), price_per_hour=2.0, projection_rtts=[])
    data = {"model": "M", "command": "splitinfer bench", "setup": "S", "prompts": ["code-1"], "plots": ["breakdown.png"],
            "config": {"max_new_tokens": 16, "repeats": 3}, "torch": "2", "machine": {"cpus": 2}, "elapsed_s": 1.0,
            "summary": s, "prefill": None}
    doc = tmp_path / "docs" / "benchmarks.md"
    doc.parent.mkdir()
    doc.write_text(f"# Benchmarks\n\nintro\n\n{report.DOCS_BEGIN}\nold results\n{report.DOCS_END}\n\n## Older\nkept\n")
    for _ in range(2):  # idempotent: the second run replaces the first
        report.update_docs(doc, data, tmp_path / "docs" / "bench")
    text = doc.read_text()
    assert "old results" not in text and text.count("### Benchmark sweep: M") == 1
    assert text.startswith("# Benchmarks\n\nintro\n") and text.endswith(f"{report.DOCS_END}\n\n## Older\nkept\n")
    assert "![breakdown.png](bench/breakdown.png)" in text and "#### Checks" in text
    doc.write_text("no markers")
    with pytest.raises(ConfigError, match="has no results section"):
        report.update_docs(doc, data, tmp_path)


def test_record_from_steps_means_add_up():
    from splitinfer.bench.runtime import record_from_steps

    steps = [{"kind": "prefill", "round_trip_ms": 500.0, "server_ms": 400.0, "cloud_compute_ms": 390.0, "local_ms": 50.0,
              "serialize_ms": 1.0, "accepted": 0, "bytes_up": 9000, "bytes_down": 9000}]
    steps += [{"kind": "decode", "round_trip_ms": rt, "server_ms": 60.0, "cloud_compute_ms": 58.0, "local_ms": 25.0,
               "serialize_ms": 0.5, "accepted": acc, "bytes_up": 1300, "bytes_down": 1270} for rt, acc in [(140.0, 1), (150.0, 3)]]
    stats = {"tokens_per_s": 12.0, "generated_tokens": 5, "decode_s": 0.35, "prefill_ms": 600.0}
    r = record_from_steps(stats, steps)
    assert r["steps"] == 2 and r["accepted_per_step"] == 2.0 and r["bytes_per_step"] == 2570.0
    assert r["network_ms"] == 85.0 and r["cloud_compute_ms"] == 58.0 and r["server_other_ms"] == 2.0
    assert r["step_ms"] == pytest.approx(145.0 + 25.5)
    parts = ("network_ms", "cloud_compute_ms", "server_other_ms", "local_compute_ms", "serialize_ms")
    assert sum(r[k] for k in parts) == pytest.approx(r["step_ms"])
    assert r["between_steps_ms"] == pytest.approx(175.0 - 170.5)  # 350 ms over 2 steps, 170.5 inside them
