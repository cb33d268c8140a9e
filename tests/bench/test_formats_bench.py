"""bench formats (every weight format side by side) and bench spec over several shards directories."""

from __future__ import annotations

import argparse
import contextlib
import json

import pytest

from splitinfer.bench import spec_formats, speculative
from splitinfer.cli import main


def _report(rates: dict[str, float], divergences: int = 0) -> dict:
    runs = [{"strategy": s, "rtt_ms": 80.0, "prompt_id": p, "repeat": 0, "tokens_per_s": rate * (1 + i / 10)}
            for s, rate in rates.items() for i, p in enumerate(("a", "b"))]
    rows = [{"strategy": s, "rtt_ms": 80.0, "tokens_per_s_whole_set": rate, "mean_accepted_pooled": 2.0,
             "rtt_efficiency": 0.5, "speedup_whole_set": 1.0} for s, rate in rates.items()]
    return {"summary": {"rows": rows, "local_only": {"tokens_per_s_whole_set": 10.0}}, "runs": runs,
            "divergences": [{}] * divergences}


def test_formats_are_paired_generation_by_generation_against_the_first():
    reports = {"float32": _report({"sequential": 5.0, "tree": 8.0}), "int8": _report({"sequential": 6.0, "tree": 12.0}, 1)}
    paired = spec_formats.paired(reports)
    assert paired["float32"]["tree@80"] == {"median": 1.0, "min": 1.0, "max": 1.0}
    assert paired["int8"]["tree@80"]["median"] == 1.5 and paired["int8"]["sequential@80"]["median"] == 1.2
    report = {"command": "c", "reference": "float32", "paired": paired,
              "formats": {k: {"summary": spec_formats.compare_row(v)} for k, v in reports.items()}}
    text = spec_formats.markdown(report)
    assert "| int8 | tree | 80 | 12.0 | 1.5x (1.5-1.5) | 2.0 | 0.5 | 1 |" in text


def test_bench_spec_over_several_shards_runs_each_prompt_on_every_one_before_the_next(monkeypatch, tmp_path):
    order, opened = [], []

    @contextlib.contextmanager
    def measuring(args, shards, prompts, strategies, rtts, local, depths):
        opened.append(str(shards))
        yield [], [], lambda rep, p: order.append((rep, p["id"], str(shards)))
        opened.remove(str(shards))

    def report(args, *rest, others):
        assert not opened, "every server stays up until the last prompt has run"
        return {"shards": args.shards, "others": others}

    prompts = [{"id": "p1"}, {"id": "p2"}]
    monkeypatch.setattr(speculative, "measuring", measuring)
    monkeypatch.setattr(speculative, "load_prompts", lambda *a: prompts)
    monkeypatch.setattr(speculative, "open_client", lambda **kw: None)
    monkeypatch.setattr(speculative, "prompt_lookup_reference", lambda *a: {})
    monkeypatch.setattr(speculative, "pin_self", lambda cpu: None)
    monkeypatch.setattr(speculative, "_report", lambda args, *rest: report(args, *rest[:-1], others=rest[-1]))
    shared = dict(rtt_ms="80", strategies="tree", prompts="x", per_category=1, in_flight="1", repeats=2,
                  max_new_tokens=8)
    each = [argparse.Namespace(shards=name, out=str(tmp_path / name), readme=None, **shared) for name in ("a", "b")]
    reports = speculative.run_interleaved(each)
    assert order == [(rep, p, shards) for rep in (0, 1) for p in ("p1", "p2") for shards in ("a", "b")]
    assert reports == [{"shards": "a", "others": ["b"]}, {"shards": "b", "others": ["a"]}]


@pytest.mark.slow
def test_bench_formats_runs_every_format_on_the_shipped_model(tmp_path):
    out = tmp_path / "formats"
    assert main(["bench", "formats", "--out", str(out), "--shards-dir", str(tmp_path / "shards"), "--formats", "float32;int8;int4,lm_head=int8", "--rows", "1,4",
                 "--contexts", "16", "--prompts", "1", "--tokens", "8", "--repeats", "1", "--cpu", "-1"]) == 0
    report = json.loads((out / "formats.json").read_text())
    assert set(report["tree_equals_sequential"]) == {"float32", "int8", "int4,lm_head=int8"}
    # int8 and int4 give every row of a step its own bits: speculation equals sequential decoding.
    assert report["tree_equals_sequential"]["int8"] == report["tree_equals_sequential"]["int4,lm_head=int8"] == "1 of 1"
    assert report["quality"]["float32"]["perplexity_vs_float32"] == 0.0
    assert {r["format"] for r in report["steps"]} == {"float32", "int8", "int4,lm_head=int8"}
    assert all(r["bound_ms"] > 0 for r in report["steps"])
    assert "| int8 |" in (out / "formats.md").read_text()
