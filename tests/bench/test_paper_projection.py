"""bench/paper_projection.py (`bench project --paper`): the paper's configuration projected from measured
parts. Interpolation is exact on measured points and linear between; every row says what each input is; the
paper's own step costs give back its own sequential figure (8.1 tok/s projected at 80 ms)."""

import argparse
import json
from pathlib import Path

import pytest

from splitinfer.bench import paper_projection as pp

ROOT = Path(__file__).resolve().parents[2]


def test_interpolation():
    assert pp.interpolate({1: 10.0, 4: 40.0}, 1) == 10.0 and pp.interpolate({1: 10.0, 4: 40.0}, 2) == 20.0
    assert pp.interpolate({1: 10.0, 4: 40.0}, 9) == 40.0  # held flat outside the measured range
    rows = [{"context": c, "rows": q, "ms": q + c} for c in (64, 2048) for q in (1, 4)]
    assert pp.grid_value(rows, "ms", 2, 64) == 66 and pp.grid_value(rows, "ms", 4, 1056) == 1060


def spec_run():
    runs = [{"strategy": s, "rows": rows, "prompt_token_ids": [0] * 50, "token_ids": [0] * 100}
            for s, rows in (("sequential", [1, 1]), ("tree", [4, 8]))]
    summary = [{"strategy": "sequential", "bound": {"a": 1.0, "drafting_ms": 0.0}},
               {"strategy": "tree", "bound": {"a": 2.0, "drafting_ms": 5.0}}]
    return {"command": "splitinfer bench spec ...", "runs": runs, "summary": {"rows": summary}}


@pytest.mark.parametrize("measured", [False, True])
def test_rows_are_labelled_and_the_papers_figure_comes_back(tmp_path, measured):
    args = argparse.Namespace(paper_rtts="20,80", trusted=None, device_step=None, laptop_gbs=60.0, bandwidth_gbs=4800.0,
                              run="run.json", cpu_step=str(ROOT / "notes/bench/step/step.json"))
    if measured:
        trusted = [{"format": "bfloat16", "threads": t, "context": c, "rows": q, "splitinfer_ms": 100.0 * t + q,
                    "bandwidth_gbps": 10.0} for t in (1, 2) for c in (64, 2048) for q in (1, 16)]
        (tmp_path / "t.json").write_text(json.dumps({"rows": trusted}))
        args.trusted = str(tmp_path / "t.json")
    result = pp.project_paper(args, spec_run())
    labels = {r["local_label"].split(":")[0] for r in result["rows"]}
    assert labels == ({"measured", "scaled", "paper, measured"} if measured else {"bound", "paper, measured"})
    assert all(r["cloud_label"].startswith(("bound", "paper")) for r in result["rows"])
    paper_seq = next(r for r in result["rows"] if r["strategy"] == "sequential" and r["trusted"].startswith("the paper"))
    assert paper_seq["tokens_per_s"]["80"] == pytest.approx(1000 / (80 + 26.2 + 15.9 + 1.0), abs=0.01)  # 8.12
    assert paper_seq["rtt_efficiency"]["80"] == pytest.approx(80 / (80 + 26.2 + 15.9 + 1.0 + paper_seq["drafting_ms"]), abs=1e-3)
    assert any("RTT efficiency at 80 ms" in line for line in pp.paper_body(result))
    if measured:  # the faster thread count, at the tree's mean rows (6) a step
        tree = next(r for r in result["rows"] if r["strategy"] == "tree" and r["trusted"].startswith("this CPU"))
        assert tree["trusted"] == "this CPU, bfloat16, 1 thread(s)" and tree["local_ms"] == pytest.approx(106.0)
    assert any("paper: lookahead" in line for line in pp.paper_body(result))
