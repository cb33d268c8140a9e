"""`splitinfer bench step-ab`: one decode step of this tree against another tree's, `splitinfer bench step` run from
each alternately.

For a kernel change: `--other-src` is another tree's `src` directory (a `git worktree` of an earlier commit, say).
Each round runs `bench step` once from each tree, in turn, in its own process with its own build of the native
kernels, so the machine's drift reaches both trees alike. Per side, context and rows: the median over the rounds
of each tree's step (each already a median of `--repeats`) and of its products (the profiled breakdown), and
other / this. Writes OUT/step_ab.json and OUT/step_ab.md; each round's own reports stay under OUT/rounds.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ..tables import table
from .harness import command_line, write
from .provenance import source_commit

COLUMNS = ["side", "context", "rows", "other step ms", "other products ms", "this step ms", "this products ms",
           "other / this", "other x", "this x"]


def bench_step(src: Path, kernels: Path | None, out: Path, args) -> dict:
    """One `bench step` run importing the tree at `src`, its kernels built under `kernels` (None: where this
    process's environment builds them); its report."""
    env = {**os.environ, "PYTHONPATH": str(src), **({"TORCH_EXTENSIONS_DIR": str(kernels)} if kernels else {})}
    command = [sys.executable, "-m", "splitinfer", "bench", "step", "--shards", args.shards, "--out", str(out),
               "--rows", args.rows, "--contexts", args.contexts, "--repeats", str(args.repeats), "--e2e-prompts", "0"]
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "step.json").read_text())


def medians(reports: list[dict]) -> dict[tuple, tuple[float, float, float]]:
    """{(side, context, rows): (step ms, products ms, x weights + attention)}, medians over the reports."""
    keyed: dict[tuple, list[tuple[float, float, float]]] = {}
    for report in reports:
        for r in report["rows"]:
            keyed.setdefault((r["side"], r["context"], r["rows"]), []).append(
                (r["splitinfer_ms"], r["breakdown_ms"]["products"], r["x_weights_attention"]))
    return {k: tuple(round(statistics.median(col), 3) for col in zip(*v)) for k, v in keyed.items()}


def run(args, log=print) -> dict:
    import splitinfer

    out = Path(args.out)
    trees = {"this tree": Path(splitinfer.__file__).parent.parent, "other tree": Path(args.other_src).resolve()}
    reports: dict[str, list[dict]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory() as other_kernels:
        kernels = {"this tree": None, "other tree": Path(other_kernels)}
        for round_ in range(args.rounds):
            for name, src in trees.items():
                log(f"round {round_ + 1} of {args.rounds}: bench step from {name}")
                rounds_dir = out / "rounds" / f"{name.split()[0]}-{round_}"
                reports[name].append(bench_step(src, kernels[name], rounds_dir, args))
    this, other = medians(reports["this tree"]), medians(reports["other tree"])
    rows = [[side, context, q, *other[(side, context, q)][:2], *this[(side, context, q)][:2],
             round(other[(side, context, q)][0] / this[(side, context, q)][0], 3), other[(side, context, q)][2],
             this[(side, context, q)][2]] for side, context, q in this]
    report = {"this_tree": source_commit(trees["this tree"]), "other_tree": source_commit(trees["other tree"]),
              "rounds": args.rounds, "repeats": args.repeats, "machine": reports["this tree"][0].get("machine"),
              "bandwidth_gbps": [r["bandwidth_gbps"] for r in reports["this tree"]], "columns": COLUMNS, "rows": rows}
    body = [f"`splitinfer bench step` ({args.shards}, {args.repeats} repetitions a run) from each tree in turn, "
            f"{args.rounds} rounds; medians over the rounds, ms. x: the step over its weights' bytes over the "
            "bandwidth plus its attention, as bench step reports it.", "",
            *table(COLUMNS, rows)]
    write(out, "step_ab", report, body, title=f"One decode step: {report['this_tree']} against {report['other_tree']}",
          command=command_line(args), log=log)
    return report
