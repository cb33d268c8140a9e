"""The developer benchmarks, each run once through the real CLI at its smallest size (bench/step_commands.py and
bench/system_commands.py): each writes its record (OUT/NAME.json under its command and provenance, OUT/NAME.md)
with the file names the stored runs under notes/bench use. Figures are never asserted, only their shape; the
ones that compile, start servers or load the shipped model are slow (`make test-all`)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

import splitinfer
from splitinfer.cli import main
from tiny import prepare_tiny

ROOT = Path(__file__).resolve().parents[2]
SRC = Path(splitinfer.__file__).parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return prepare_tiny(tmp_path_factory.mktemp("lab"), "llama", 1, 1)[1]


def bench(out: Path, name: str, *argv: str) -> tuple[dict, str]:
    """`splitinfer bench ARGV` (which must succeed) and the record it left: OUT/NAME.json and OUT/NAME.md."""
    assert main(["bench", *argv]) == 0
    record = json.loads((out / f"{name}.json").read_text())
    md = (out / f"{name}.md").read_text()
    assert record["command"] == "splitinfer bench " + shlex.join(argv)  # the exact command, to type again
    assert record["provenance"]["torch"] and f"Command: `{record['command']}`" in md
    return record, md


def test_scripts_hold_no_benchmark():
    assert not [p.name for p in (ROOT / "scripts").iterdir() if p.name.startswith(("bench_", "gpu_projection",
                                                                                     "paper_projection"))]


@pytest.mark.parametrize("kernel, rows", [("w4a8", 3), ("w8a8-stream", 2),
                                          pytest.param("w8a8", 2, marks=pytest.mark.slow)])  # 28 MB quantized: ~40 s
def test_kernels(tmp_path, kernel, rows):
    record, md = bench(tmp_path, kernel.replace("-", "_"), "kernels", "--kernel", kernel, "--rows", "1",
                       "--repeats", "1", "--out", str(tmp_path))
    assert len(record["rows"]) == rows and record["provenance"]["threads"] == 1  # measured on one thread
    assert all(r["ratio"] > 0 for r in record["rows"]) and md.count("\n| ") == rows + 1


def test_arena(tmp_path, tiny):
    record, md = bench(tmp_path, "arena", "arena", "--shards", str(tiny), "--out", str(tmp_path), "--rows", "1,2",
                       "--rounds", "2")
    assert [(r["side"], r["rows"]) for r in record["rows"]] == [("cloud", 1), ("cloud", 2), ("local", 1), ("local", 2)]
    assert all(r["identical"] for r in record["rows"]) and "| local | 2 |" in md


@pytest.mark.slow  # torch.compile compiles every graph first
def test_compile(tmp_path, tiny):
    record, _ = bench(tmp_path, "compile", "compile", "--shards", str(tiny), "--out", str(tmp_path), "--rows", "1",
                      "--contexts", "4", "--repeats", "1", "--decode-blocks", "2", "--cpu", "-1")
    assert len(record["results"]) == 2 and len(record["decode"]) == 2
    assert all(r["max_abs_diff"] < 1e-3 for r in record["first_calls"])


@pytest.mark.slow  # a fresh process per half
def test_memory(tmp_path, tiny):
    record, _ = bench(tmp_path, "memory", "memory", "--shards", str(tiny), "--out", str(tmp_path))
    assert [r["half"] for r in record["rows"]] == ["cloud", "local"]
    assert all(r["file_mib"] > 0 for r in record["rows"])


def test_step_ab_alternates_the_trees_and_takes_medians_over_rounds(tmp_path, monkeypatch):
    from splitinfer.bench import step_ab

    ran = []

    def fake_step(src, kernels, out, args):  # bench step in a process of its own, from `src`: its report
        ran.append((src, out.name))
        ms = 10.0 if kernels is None else 12.0  # this tree, then the other, whose kernels build apart
        ms += len(ran) % 3
        return {"rows": [{"side": "cloud", "context": 64, "rows": 1, "splitinfer_ms": ms, "x_weights_attention": 1.5,
                          "breakdown_ms": {"products": ms / 2}}], "bandwidth_gbps": 9.0, "machine": "m"}

    monkeypatch.setattr(step_ab, "bench_step", fake_step)
    record, md = bench(tmp_path, "step_ab", "step-ab", "--other-src", str(SRC), "--out", str(tmp_path),
                       "--rounds", "3")
    assert [name for _, name in ran] == ["this-0", "other-0", "this-1", "other-1", "this-2", "other-2"]
    # this tree: 10 + (1, 0, 2) -> median 11; the other: 12 + (2, 1, 0) -> median 13
    assert record["rows"] == [["cloud", 64, 1, 13.0, 6.5, 11.0, 5.5, round(13 / 11, 3), 1.5, 1.5]]
    assert "| cloud | 64 | 1 | 13.0 |" in md


@pytest.mark.slow  # bench step in a process of its own from each tree, the other's kernels built apart (minutes)
def test_step_ab_runs_bench_step_from_each_tree(tmp_path, tiny):
    record, _ = bench(tmp_path, "step_ab", "step-ab", "--other-src", str(SRC), "--out", str(tmp_path), "--shards",
                      str(tiny), "--rows", "1", "--contexts", "4", "--repeats", "1", "--rounds", "1")
    assert [r[:3] for r in record["rows"]] == [["cloud", 4, 1], ["local", 4, 1]]
    assert (tmp_path / "rounds" / "other-0" / "step.json").is_file()


def test_trusted_half_rebuilds_its_table_from_the_runs_under_out(tmp_path, tiny):
    assert main(["bench", "step", "--shards", str(tiny), "--out", str(tmp_path / "float32-1t"), "--rows", "1",
                 "--contexts", "4", "--repeats", "1", "--cpu", "-1", "--sides", "local"]) == 0
    assert main(["bench", "trusted-half", "--out", str(tmp_path), "--report-only"]) == 0
    result = json.loads((tmp_path / "trusted-half.json").read_text())
    assert [(r["side"], r["format"], r["rows"]) for r in result["rows"]] == [("local", "float32", 1)]
    assert result["commands"] == []  # --report-only measured nothing
    assert "| local |" in (tmp_path / "trusted-half.md").read_text()


@pytest.mark.slow  # an echo server and the emulator as processes
def test_wan(tmp_path):
    record, _ = bench(tmp_path, "wan", "wan", "--out", str(tmp_path), "--rtt-ms", "5", "--count", "2", "--rounds", "1")
    assert [r[0] for r in record["rows"]] == ["no proxy", "this tree"] and record["rows"][1][2] == 5.0


def test_scale(tmp_path, smollm2_shards):  # a server as a process, the shipped model's prompts: slow (conftest)
    record, _ = bench(tmp_path, "tp1", "scale", "--shards", str(smollm2_shards), "--out", str(tmp_path), "--name",
                      "tp1", "--sessions", "2", "--tokens", "2")
    assert record["identical_outputs"] and [r["config"] for r in record["runs"]] == ["serve"]


def test_detok(tmp_path, smollm2_shards):  # the shipped tokenizer: slow (conftest)
    (tmp_path / "run.json").write_text(json.dumps({"runs": [{"token_ids": [28, 1848, 314, 253, 1944, 30]}]}))
    record, _ = bench(tmp_path, "detok", "detok", "--shards", str(smollm2_shards), "--out", str(tmp_path), "--runs",
                      str(tmp_path / "run.json"), "--tokens", "40", "--window", "16")
    assert record["identical"] and [w["tokens"] for w in record["incremental"]] == ["1-16", "17-32", "33-40"]


def test_drafting(tmp_path):
    replies = [{"prompt": list(range(100, 120)), "reply": list(range(120, 140)) + list(range(120, 130))}]
    (tmp_path / "replay.json").write_text(json.dumps(replies))
    record, _ = bench(tmp_path, "drafting", "drafting", "--replies", str(tmp_path / "replay.json"), "--out",
                      str(tmp_path), "--repeats", "1")
    assert [r[0] for r in record["rows"]] == ["warm", "cold"] and record["rows"][0][1] == record["rows"][1][1] > 0


def spec_run(path: Path) -> Path:
    """A stored bench spec run as far as the projections read it."""
    runs = [{"strategy": s, "rows": rows, "prompt_token_ids": [0] * 50, "token_ids": [0] * 100}
            for s, rows in (("sequential", [1, 1]), ("tree", [4, 8]))]
    bound = {"rtt_ms": 80.0, "local_ms": 20.0, "drafting_ms": 5.0, "a": 2.0}
    summary = [{"strategy": s, "bound": bound, "tokens_per_s_whole_set": 15.0} for s in ("sequential", "tree")]
    path.write_text(json.dumps({"command": "splitinfer bench spec ...", "runs": runs, "summary": {"rows": summary}}))
    return path


def test_project(tmp_path, tiny):
    run = spec_run(tmp_path / "speculative.json")
    record, md = bench(tmp_path, "projection", "project", str(run), "--out", str(tmp_path), "--shards", str(tiny),
                       "--cloud-ms", "0,3")
    tree = record["rows"][1]["projected"]
    assert tree[0]["tokens_per_s"] == round(1000 * 2.0 / (80 + 20 + 0 + 5), 2)
    assert tree[1]["drafting_off_path_tokens_per_s"] == round(1000 * 2.0 / (80 + 20 + 3), 2)
    assert "projected (not measured)" in md


def test_project_paper(tmp_path):
    run = spec_run(tmp_path / "speculative.json")
    record, md = bench(tmp_path, "projection", "project", str(run), "--paper", "--out", str(tmp_path),
                       "--paper-rtts", "20,80", "--cpu-step", str(ROOT / "notes/bench/step/step.json"))
    assert record["rtts_ms"] == [20.0, 80.0] and "paper: lookahead" in md
