"""The int4 product alone: kernels/w4a8.py's kernel against PyTorch's `_weight_int4pack_mm_for_cpu`, one thread.

    python scripts/bench_w4a8.py --out notes/bench/w4a8-kernel

For SmolLM2-135M's fused shapes (gate/up 3072x576, down 576x1536, q/k/v 960x576) at 1-32 rows: the median of
200 calls after 20 warm-up calls, both kernels on the same random Q4_1 weight (seed 0), pinned to core 0.
Writes OUT/w4a8.json and OUT/w4a8.md. The weight stays in cache between calls, so this times the kernels, not
memory; `bench step` and `bench formats` time whole steps.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from splitinfer import kernels
from splitinfer.kernels import w4a8
from splitinfer.model import formats, linears

SHAPES = ((3072, 576), (576, 1536), (960, 576))
ROWS = (1, 2, 4, 5, 8, 16, 32)


def median_us(call, repeats: int = 200) -> float:
    for _ in range(20):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2] * 1e6


def measure(n: int, k: int) -> list[dict]:
    state = formats.quantize(torch.randn(n, k) * 0.05, "int4")
    packed = w4a8.pack(state["qweight"], state["scale"], state["min"])
    pytorch = linears.TorchInt4Linear(k, n)  # PyTorch's kernel, chosen by class
    pytorch.load_state_dict(state)
    pytorch.finish()
    out = []
    for rows in ROWS:
        x = torch.randn(rows, k)
        ours, theirs = median_us(lambda: w4a8.matmul(x, packed, n)), median_us(lambda: pytorch(x))
        out.append({"n": n, "k": k, "rows": rows, "w4a8_us": round(ours, 1), "pytorch_us": round(theirs, 1),
                    "ratio": round(theirs / ours, 2), "w4a8_gops": round(2 * n * k * rows / ours / 1e3, 1)})
    return out


def run(name: str, measure, shapes, header: list[str], cells) -> None:
    """Parse --out, pin one thread to core 0, measure every shape (seed 0), write OUT/NAME.json and
    OUT/NAME.md (a table of `header` with `cells(row)` a row) with the command that made them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    if not kernels.ensure():
        raise SystemExit(f"splitinfer's kernels do not run on this machine ({kernels.status()['reason']}): nothing to compare.")
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = [r for n, k in shapes for r in measure(n, k)]
    command = f"python scripts/bench_{name}.py --out {args.out}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps({"command": command, "torch": torch.__version__, "rows": rows}, indent=1))
    lines = [f"Command: `{command}` (torch {torch.__version__}; one thread, core 0; medians)", "",
             "| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    lines += ["| " + " | ".join(str(c) for c in cells(r)) + " |" for r in rows]
    (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    run("w4a8", measure, SHAPES, ["weight", "rows", "w4a8 us", "PyTorch int4 us", "PyTorch / w4a8", "w4a8 GOP/s"],
        lambda r: [f"{r['n']}x{r['k']}", r["rows"], r["w4a8_us"], r["pytorch_us"], r["ratio"], r["w4a8_gops"]])


if __name__ == "__main__":
    main()
