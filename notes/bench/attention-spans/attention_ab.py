"""rows_attention at Mistral-7B's attention shape (32 heads, 8 key/value heads, 128 wide): two builds of the
kernel library (two source trees), each in its own process, alternated round by round; medians of 30 calls a
configuration, then the median over rounds. Both builds must give the same bits (checked on the first round).

    python notes/bench/attention-spans/attention_ab.py --before /tmp/old/src --after src \\
        --out notes/bench/attention-spans --rounds 3

Each tree builds its library into its own extension cache (TORCH_EXTENSIONS_DIR=/tmp/attention-ab-<name>).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HEADS, KV_HEADS, DIM = 32, 8, 128
CONTEXTS, ROWS = (64, 2048), (1, 4, 8, 16)

CHILD = r"""
import json, statistics, sys, time, torch
from splitinfer import kernels
assert kernels.ensure(), "the kernels did not load"
torch.set_num_threads(2)
gen = torch.Generator().manual_seed(0)
result = {}
for ctx in CONTEXTS:
    for rows in ROWS:
        slots = ctx + rows
        k, v = (torch.randn(KV_HEADS, slots, DIM, generator=gen) for _ in range(2))
        q = torch.randn(HEADS, rows, DIM, generator=gen)
        index, offsets = [], [0]
        for r in range(rows):  # the prefix, then the block's rows up to this one (a chain)
            index += list(range(ctx)) + [ctx + i for i in range(r + 1)]
            offsets.append(len(index))
        args = (q, k, v, torch.tensor(index), torch.tensor(offsets), DIM ** -0.5)
        out = torch.ops.splitinfer.rows_attention(*args)
        times = []
        for _ in range(30):
            t = time.perf_counter()
            torch.ops.splitinfer.rows_attention(*args)
            times.append(time.perf_counter() - t)
        result[f"{ctx}/{rows}"] = {"ms": statistics.median(times) * 1e3, "sum": float(out.double().sum())}
print(json.dumps(result))
"""


def run(src: str, name: str) -> dict:
    env = {**os.environ, "PYTHONPATH": src, "TORCH_EXTENSIONS_DIR": f"/tmp/attention-ab-{name}"}
    code = f"CONTEXTS, ROWS, HEADS, KV_HEADS, DIM = {CONTEXTS}, {ROWS}, {HEADS}, {KV_HEADS}, {DIM}\n" + CHILD
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", required=True)
    parser.add_argument("--after", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rounds = [{name: run(src, name) for name, src in (("before", args.before), ("after", args.after))}
              for _ in range(args.rounds)]
    rows = []
    for key in rounds[0]["before"]:
        before = statistics.median(r["before"][key]["ms"] for r in rounds)
        after = statistics.median(r["after"][key]["ms"] for r in rounds)
        same = rounds[0]["before"][key]["sum"] == rounds[0]["after"][key]["sum"]
        ctx, q = key.split("/")
        rows.append({"context": int(ctx), "rows": int(q), "before_ms": round(before, 3), "after_ms": round(after, 3),
                     "x": round(before / after, 2), "same_sum": same})
    command = "python " + " ".join(sys.argv)
    report = {"command": command, "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "dim": DIM}, "rounds": args.rounds,
              "threads": 2, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attention_ab.json").write_text(json.dumps(report, indent=1) + "\n")
    table = ["| context | rows | before ms | after ms | before / after | same output sum |", "|---:|---:|---:|---:|---:|---|"]
    table += [f"| {r['context']} | {r['rows']} | {r['before_ms']} | {r['after_ms']} | {r['x']} | {r['same_sum']} |"
              for r in rows]
    (args.out / "attention_ab.md").write_text(
        f"# rows_attention before and after, one layer's call\n\n`{command}`\n\n32 heads, 8 key/value heads, 128 wide; "
        f"two threads; medians of 30 calls, median over {args.rounds} alternated rounds.\n\n" + "\n".join(table) + "\n")


if __name__ == "__main__":
    main()
