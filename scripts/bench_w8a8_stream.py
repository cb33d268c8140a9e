"""The int8 product streamed from memory: kernels/w8a8.py's kernel with the hardware prefetchers alone (its
default) against asking for the weight 16 KB ahead with prefetcht0 (what it did before), one thread.

    python scripts/bench_w8a8_stream.py --out notes/bench/w8a8-prefetch

Random int8 weights (seed 0) too large for the caches, as a decode step meets them: SmolLM2-135M's LM head
(49152x576, 28 MB) and a cloud step's 104 products (26 layers of q/k/v 960x576, o 576x576, gate/up 3072x576 and
down 576x1536: 92 MB), at 1-8 rows of quantized inputs. A 64 MB buffer is written before every timed call;
the two settings alternate in each of 16 rounds (the first dropped); medians. scripts/bench_w8a8.py times the
kernel against FBGEMM with the weight in cache.
"""

from __future__ import annotations

import statistics
import time

import torch
from bench_w4a8 import run

from splitinfer.kernels import w8a8

LAYER = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # SmolLM2-135M's fused products, [N, K]
WEIGHTS = (("LM head 49152x576", ((49152, 576),)), ("cloud step, 26 layers", LAYER * 26))
ROWS = (1, 2, 3, 4, 8)
AHEAD = 16384  # bytes, the distance the kernel asked for before
ROUNDS = 16


def packed(shapes) -> list[tuple]:
    out = []
    for n, k in shapes:
        qweight = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        out.append((*w8a8.pack(qweight), torch.rand(n) / 100 + 1e-3, k))
    return out


def measure(label: str, shapes) -> list[dict]:
    weights, evict = packed(shapes), torch.zeros(16 << 20)
    rows_out = []
    for rows in ROWS:
        inputs = [torch.randint(-127, 128, (rows, k)).float() for *_, k in weights]
        times = {0: [], AHEAD: []}
        for round_ in range(ROUNDS):
            for prefetch in times:
                evict.add_(1)
                start = time.perf_counter()
                for (pk, sums, scale, _), x in zip(weights, inputs):
                    w8a8.matmul(x, pk, sums, scale, prefetch=prefetch)
                if round_:
                    times[prefetch].append((time.perf_counter() - start) * 1e6)
        hardware, ahead = statistics.median(times[0]), statistics.median(times[AHEAD])
        mb = sum(pk.numel() for pk, *_ in weights) / 1e6
        rows_out.append({"weights": label, "rows": rows, "megabytes": round(mb, 1), "hardware_us": round(hardware, 1),
                         "prefetch_16k_us": round(ahead, 1), "ratio": round(ahead / hardware, 2),
                         "hardware_gb_s": round(mb / hardware * 1e3, 1)})
    return rows_out


def main() -> None:
    run("w8a8_stream", measure, WEIGHTS,
        ["weights", "rows", "MB", "hardware prefetchers us", "prefetcht0 16 KB us", "ratio", "GB/s (hardware)"],
        lambda r: [r["weights"], r["rows"], r["megabytes"], r["hardware_us"], r["prefetch_16k_us"], r["ratio"],
                   r["hardware_gb_s"]])


if __name__ == "__main__":
    main()
