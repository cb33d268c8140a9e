"""`splitinfer bench-kernels`: what the weight products of one decode step cost by block rows, through
`F.linear` and through the few-rows form of model/rows.py (weight @ x.T, one row padded to two), side by
side on this machine.

Three groups of a shard's own weight matrices: every decoder layer's linears (local and cloud halves, in
layer order, so the weights stream from memory as in a real pass), the LM head, and the draft head's
readout when the shard has a head. For each row count and form, one timed pass over the group; the
configurations run in a shuffled order each repetition, after a warm-up, and the medians are reported.
Inputs are random: the time of a product does not depend on the values.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..model import rows
from ..model.shards import load_cloud, load_local

# rows.linear picks between these two by row count; both are timed at every count to show where it should.
FORMS = {"F.linear": F.linear, "weight @ x.T": rows.few_rows_product}


def weight_groups(shards: Path) -> dict[str, list[torch.Tensor]]:
    local, cloud = load_local(shards / "local", verify=False), load_cloud(shards / "cloud", verify=False)
    layers = [m.weight for stack in (local.head, cloud.stack, local.tail) for m in stack.modules()
              if isinstance(m, nn.Linear)]
    groups = {"layers": layers, "lm_head": [local.lm_head.weight]}
    drafter = shards / "local" / "drafter"
    if drafter.exists():
        from ..model.drafthead import load_shard_head

        groups["draft_readout"] = [load_shard_head(drafter, local).draft_weight]
    return groups


def _time_pass(weights: list[torch.Tensor], form, q: int) -> float:
    inputs = {w.shape[1]: torch.randn(q, w.shape[1]) for w in weights}
    t0 = time.perf_counter()
    for w in weights:
        form(inputs[w.shape[1]], w)
    return (time.perf_counter() - t0) * 1e3


@torch.inference_mode()
def measure(groups: dict[str, list[torch.Tensor]], row_counts: list[int], repeats: int) -> dict:
    configs = [(g, name, q) for g in groups for name in FORMS for q in row_counts]
    times: dict[tuple, list[float]] = {c: [] for c in configs}
    rng = random.Random(0)
    for rep in range(repeats + 1):  # the first round warms up and is dropped
        rng.shuffle(configs)
        for g, name, q in configs:
            ms = _time_pass(groups[g], FORMS[name], q)
            if rep:
                times[(g, name, q)].append(ms)
    return {g: {name: {str(q): round(statistics.median(times[(g, name, q)]), 3) for q in row_counts}
                for name in FORMS} for g in groups}


def markdown(report: dict) -> str:
    qs = report["row_counts"]
    lines = ["# Weight products by block rows: F.linear against the few-rows form", "",
             f"Command: `{report['command']}`", "",
             f"torch {report['torch']}, {report['threads']} thread(s), {report['repeats']} repetitions after a "
             f"warm-up, medians in ms; model/rows.py takes weight @ x.T (one row padded to two) for 1..{report['small_rows_max']} rows.", "",
             "| group | form | " + " | ".join(f"{q} rows" for q in qs) + " |",
             "|---|---|" + "---:|" * len(qs)]
    for g, forms in report["ms"].items():
        for name, by_q in forms.items():
            lines.append(f"| {g} | {name} | " + " | ".join(f"{by_q[str(q)]:.1f}" for q in qs) + " |")
    return "\n".join(lines) + "\n"


def run_kernels_bench(args) -> dict:
    torch.set_num_threads(args.threads)
    row_counts = [int(q) for q in args.rows.split(",")]
    report = {
        "command": "splitinfer " + " ".join(sys.argv[1:]),
        "torch": torch.__version__, "threads": args.threads, "repeats": args.repeats,
        "small_rows_max": rows.SMALL_ROWS_MAX, "row_counts": row_counts,
        "ms": measure(weight_groups(Path(args.shards)), row_counts, args.repeats),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "kernels.md").write_text(markdown(report))
    print(markdown(report))
    return report
