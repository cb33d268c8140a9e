"""The int8 product alone: kernels/w8a8.py's kernel against FBGEMM's (what Int8Linear used before) and the float32
product of the same weight (F.linear), one thread.

    python scripts/bench_w8a8.py --out notes/bench/w8a8-kernel

For SmolLM2-135M's int8 LM head (49152x576: 28 MB, streamed from memory on every call) and a draft head's
readout of its 8192 most frequent tokens (8192x576), at 1-16 rows: both kernels through Int8Linear on the
same random weight (seed 0), pinned to core 0, medians as scripts/bench_w4a8.py takes them. Writes
OUT/w8a8.json and OUT/w8a8.md; `bench step` and `bench formats` time whole steps.
"""

from __future__ import annotations

import torch
from bench_w4a8 import median_us, run

from splitinfer.model import formats, linears

SHAPES = ((49152, 576), (8192, 576))
ROWS = (1, 2, 4, 8, 16)


def linear(state: dict, n: int, k: int, ours: bool) -> linears.Int8Linear:
    module = (linears.W8A8Linear if ours else linears.FbgemmLinear)(k, n)  # the kernel, chosen by class
    module.load_state_dict(state)
    module.finish()
    return module


def measure(n: int, k: int) -> list[dict]:
    state = formats.quantize(torch.randn(n, k) * 0.05, "int8")
    ours, fbgemm = linear(state, n, k, True), linear(state, n, k, False)
    weight = formats.dequantize(state)
    out = []
    for rows in ROWS:
        x = torch.randn(rows, k)
        with torch.inference_mode():
            a, b = median_us(lambda: ours(x), 50), median_us(lambda: fbgemm(x), 50)
            f = median_us(lambda: torch.nn.functional.linear(x, weight), 50)
        out.append({"n": n, "k": k, "rows": rows, "w8a8_us": round(a, 1), "fbgemm_us": round(b, 1),
                    "ratio": round(b / a, 2), "float32_us": round(f, 1)})
    return out


def main() -> None:
    run("w8a8", measure, SHAPES, ["weight", "rows", "w8a8 us", "FBGEMM us", "FBGEMM / w8a8", "float32 us"],
        lambda r: [f"{r['n']}x{r['k']}", r["rows"], r["w8a8_us"], r["fbgemm_us"], r["ratio"], r["float32_us"]])


if __name__ == "__main__":
    main()
