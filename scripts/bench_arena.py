"""A decode step with its integer weights in one block of huge pages (model/arena.py, the default) against
each weight in its own allocation (SPLITINFER_ARENA=0), both copies of the model in one process, one thread.

    python scripts/bench_arena.py --shards shards/formats/int8 --out notes/bench/arena

Both copies load the same shards; bench step's sides (the cloud's middle layers; the local head and tail
layers, final norm and LM head) run one block of each row count after 64 cached rows. In each round the two
copies run alternately (the order flips every round; the first round is dropped), so the machine's drift
falls on both alike; medians of the rounds, and the median of the per-round ratios. Every output of the two
copies is compared bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from splitinfer.bench.step import build_sides
from splitinfer.launch import pin_self
from splitinfer import kernels
from splitinfer.model import arena


def huge_page_mb() -> float:
    """This process's anonymous memory in transparent huge pages, MB (Linux; 0 elsewhere)."""
    try:
        text = Path("/proc/self/smaps_rollup").read_text()
    except OSError:
        return 0.0
    line = next((x for x in text.splitlines() if x.startswith("AnonHugePages:")), "AnonHugePages: 0 kB")
    return int(line.split()[1]) / 1024


def load(shards: Path, rows: int, gathered: bool) -> list:
    os.environ[arena.ENV] = "1" if gathered else "0"
    try:
        return build_sides(shards, (64,), (1, rows))
    finally:
        del os.environ[arena.ENV]


@torch.inference_mode()
def compare(scattered, gathered, rows: int, rounds: int) -> dict:
    blocks = (scattered.block(rows), gathered.block(rows))
    times: tuple[list, list] = ([], [])
    same = True
    for round_ in range(rounds + 1):
        outputs = [None, None]
        for which in (0, 1) if round_ % 2 else (1, 0):
            side = (scattered, gathered)[which]
            start = time.perf_counter()
            outputs[which] = side.ours(rows, blocks[which])
            if round_:
                times[which].append((time.perf_counter() - start) * 1e3)
        same = same and torch.equal(outputs[0], outputs[1])
    before, after = statistics.median(times[0]), statistics.median(times[1])
    return {"side": scattered.name, "rows": rows, "scattered_ms": round(before, 3), "arena_ms": round(after, 3),
            "ratio": round(before / after, 3),
            "median_round_ratio": round(statistics.median(a / b for a, b in zip(*times)), 3), "identical": same}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--rows", default="1,2,4,5,6,8")
    parser.add_argument("--rounds", type=int, default=100)
    args = parser.parse_args()
    if not kernels.ensure():
        raise SystemExit("splitinfer's kernels do not run on this machine: the weights are not packed for them.")
    pin_self(0, 1)
    rows = [int(r) for r in args.rows.split(",")]
    scattered = load(args.shards, max(rows), gathered=False)
    before = huge_page_mb()
    gathered = load(args.shards, max(rows), gathered=True)
    huge = huge_page_mb() - before
    results = [compare(a, b, q, args.rounds) for a, b in zip(scattered, gathered) for q in rows]
    command = f"python scripts/bench_arena.py --shards {args.shards} --out {args.out} --rows {args.rows} --rounds {args.rounds}"
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"command": command, "torch": torch.__version__, "huge_page_mb": round(huge, 1), "rows": results}
    (args.out / "arena.json").write_text(json.dumps(record, indent=1))
    lines = [f"Command: `{command}` (torch {torch.__version__}; one thread, core 0; medians of {args.rounds} "
             f"alternating rounds). The arena's copy took {huge:.0f} MB of transparent huge pages.", "",
             "| side | rows | own allocations, ms | arena, ms | ratio | median round ratio | identical |",
             "|---|---:|---:|---:|---:|---:|---|"]
    lines += [f"| {r['side']} | {r['rows']} | {r['scattered_ms']} | {r['arena_ms']} | {r['ratio']} | "
              f"{r['median_round_ratio']} | {r['identical']} |" for r in results]
    (args.out / "arena.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
