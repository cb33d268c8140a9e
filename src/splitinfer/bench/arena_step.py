"""`splitinfer bench arena`: a decode step with its integer weights in one block of huge pages (model/arena.py, the
default) against each weight in its own allocation (SPLITINFER_ARENA=0), both copies of the model in one process,
one thread pinned to core 0.

Both copies load the same shards; bench step's sides (the cloud's middle layers; the local head and tail layers,
final norm and LM head) run one block of each row count after 64 cached rows. The two copies run alternately
round by round (bench/harness.py: the order turns every round, the first round is dropped), so the machine's
drift falls on both alike; medians of the rounds, and the median of the per-round ratios. Every output of the
two copies is compared bit for bit. Writes OUT/arena.json and OUT/arena.md.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .. import kernels
from ..errors import ConfigError
from ..launch import pinned
from ..model import arena
from ..tables import table
from .harness import command_line, median_ms, paired_ratio, rounds, write
from .side import Side, build_sides

CONTEXT = 64  # cached rows before the block


def huge_page_mb() -> float:
    """This process's anonymous memory in transparent huge pages, MB (Linux; 0 elsewhere)."""
    try:
        text = Path("/proc/self/smaps_rollup").read_text()
    except OSError:
        return 0.0
    line = next((x for x in text.splitlines() if x.startswith("AnonHugePages:")), "AnonHugePages: 0 kB")
    return int(line.split()[1]) / 1024


def load(shards: Path, rows: int, gathered: bool) -> list[Side]:
    os.environ[arena.ENV] = "1" if gathered else "0"
    try:
        return build_sides(shards, (CONTEXT,), (1, rows))
    finally:
        del os.environ[arena.ENV]


@torch.inference_mode()
def compare(scattered: Side, gathered: Side, rows: int, repeats: int) -> dict:
    blocks = {"scattered": scattered.block(rows), "arena": gathered.block(rows)}
    identical = []
    times = rounds({"scattered": lambda: scattered.ours(rows, blocks["scattered"]),
                    "arena": lambda: gathered.ours(rows, blocks["arena"])}, repeats,
                   check=lambda out: identical.append(torch.equal(out["scattered"], out["arena"])))
    before, after = median_ms(times["scattered"]), median_ms(times["arena"])
    return {"side": scattered.name, "rows": rows, "scattered_ms": before, "arena_ms": after,
            "ratio": round(before / after, 3), "median_round_ratio": paired_ratio(times["scattered"], times["arena"]),
            "identical": all(identical)}


def measure(shards: Path, rows: list[int], repeats: int) -> tuple[float, list[dict]]:
    """MB of huge pages the arena's copy took, and a row per side and block rows."""
    scattered = load(shards, max(rows), gathered=False)
    before = huge_page_mb()
    gathered = load(shards, max(rows), gathered=True)
    huge = round(huge_page_mb() - before, 1)
    return huge, [compare(a, b, q, repeats) for a, b in zip(scattered, gathered) for q in rows]


def run(args, log=print) -> dict:
    if not kernels.ensure():
        raise ConfigError("splitinfer's kernels do not run on this machine: the weights are not packed for them.")
    rows = [int(r) for r in args.rows.split(",")]
    with pinned(0, 1):  # the record's provenance is taken inside: one thread, core 0
        huge, results = measure(Path(args.shards), rows, args.rounds)
        body = [f"One thread, core 0; {CONTEXT} cached rows; medians of {args.rounds} alternating rounds. The "
                f"arena's copy took {huge:.0f} MB of transparent huge pages.", "",
                *table(["side", "rows", "own allocations, ms", "arena, ms", "ratio", "median round ratio", "identical"],
                       [[r["side"], r["rows"], r["scattered_ms"], r["arena_ms"], r["ratio"], r["median_round_ratio"],
                         r["identical"]] for r in results])]
        record = {"huge_page_mb": huge, "rounds": args.rounds, "rows": results}
        write(Path(args.out), "arena", record, body, title="Integer weights in one huge-page arena against their own "
              "allocations", command=command_line(args), log=log)
    return record
