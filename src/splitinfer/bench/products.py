"""`splitinfer bench kernels`: one weight product alone, splitinfer's kernel (kernels/) against the one it replaced.

- `w8a8`: kernels/w8a8.py's int8 product against FBGEMM's (what Int8Linear used before) and the float32 product
  of the same weight (F.linear), for SmolLM2-135M's int8 LM head (49152x576: 28 MB, streamed from memory on
  every call) and a draft head's readout of its 8192 most frequent tokens (8192x576), 1-16 rows.
- `w4a8`: kernels/w4a8.py's int4 product against PyTorch's `_weight_int4pack_mm_for_cpu`, for SmolLM2-135M's
  fused shapes (gate/up 3072x576, down 576x1536, q/k/v 960x576), 1-32 rows.
- `w8a8-stream`: the int8 kernel streaming weights too large for the caches, as a decode step meets them (the
  LM head; a cloud step's 104 products: 26 layers of q/k/v, o, gate/up and down, 92 MB), with the hardware
  prefetchers alone (its default) against asking for the weight 16 KB ahead with prefetcht0 (what it did
  before); a 64 MB buffer is written before every timed call, the two settings alternate round by round.

One thread pinned to core 0, random weights (seed 0), medians (bench/harness.py). The first two keep the
weight in cache between calls, so they time the kernels, not memory; `bench step` and `bench formats` time
whole steps. Writes OUT/w8a8, OUT/w4a8 or OUT/w8a8_stream .json and .md.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import torch

from .. import kernels
from ..errors import ConfigError
from ..kernels import w4a8, w8a8
from ..launch import pinned
from ..model import formats, linears
from ..tables import table
from .harness import command_line, rounds, timed, write

W8A8_SHAPES = ((49152, 576), (8192, 576))  # [N, K]
W4A8_SHAPES = ((3072, 576), (576, 1536), (960, 576))
LAYER = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # SmolLM2-135M's fused products, [N, K]
STREAMED = (("LM head 49152x576", ((49152, 576),)), ("cloud step, 26 layers", LAYER * 26))
AHEAD = 16384  # bytes, the distance the int8 kernel asked for before
EVICT_FLOATS = 16 << 20  # 64 MB written before every streamed call


def median_us(call, repeats: int, warmup: int) -> float:
    return statistics.median(timed(call, repeats, warmup)) * 1e6


def _int8_linear(state: dict, n: int, k: int, ours: bool) -> linears.Int8Linear:
    module = (linears.W8A8Linear if ours else linears.FbgemmLinear)(k, n)  # the kernel, chosen by class
    module.load_state_dict(state)
    module.finish()
    return module


@torch.inference_mode()
def measure_w8a8(rows: tuple[int, ...], repeats: int) -> list[dict]:
    out = []
    for n, k in W8A8_SHAPES:
        state = formats.quantize(torch.randn(n, k) * 0.05, "int8")
        ours, fbgemm = _int8_linear(state, n, k, True), _int8_linear(state, n, k, False)
        weight = formats.dequantize(state)
        for q in rows:
            x = torch.randn(q, k)
            a, b = median_us(lambda: ours(x), repeats, 20), median_us(lambda: fbgemm(x), repeats, 20)
            f = median_us(lambda: torch.nn.functional.linear(x, weight), repeats, 20)
            out.append({"n": n, "k": k, "rows": q, "w8a8_us": round(a, 1), "fbgemm_us": round(b, 1),
                        "ratio": round(b / a, 2), "float32_us": round(f, 1)})
    return out


def measure_w4a8(rows: tuple[int, ...], repeats: int) -> list[dict]:
    out = []
    for n, k in W4A8_SHAPES:
        state = formats.quantize(torch.randn(n, k) * 0.05, "int4")
        packed = w4a8.pack(state["qweight"], state["scale"], state["min"])
        pytorch = linears.TorchInt4Linear(k, n)  # PyTorch's kernel, chosen by class
        pytorch.load_state_dict(state)
        pytorch.finish()
        for q in rows:
            x = torch.randn(q, k)
            ours = median_us(lambda: w4a8.matmul(x, packed, n), repeats, 20)
            theirs = median_us(lambda: pytorch(x), repeats, 20)
            out.append({"n": n, "k": k, "rows": q, "w4a8_us": round(ours, 1), "pytorch_us": round(theirs, 1),
                        "ratio": round(theirs / ours, 2), "w4a8_gops": round(2 * n * k * q / ours / 1e3, 1)})
    return out


def _packed(shapes) -> list[tuple]:
    out = []
    for n, k in shapes:
        qweight = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        out.append((*w8a8.pack(qweight), torch.rand(n) / 100 + 1e-3, k))
    return out


def measure_w8a8_stream(rows: tuple[int, ...], repeats: int) -> list[dict]:
    out, evict = [], torch.zeros(EVICT_FLOATS)
    for label, shapes in STREAMED:
        weights = _packed(shapes)
        megabytes = sum(pk.numel() for pk, *_ in weights) / 1e6
        for q in rows:
            inputs = [torch.randint(-127, 128, (q, k)).float() for *_, k in weights]

            def products(prefetch: int, inputs=inputs) -> None:
                for (pk, sums, scale, _), x in zip(weights, inputs):
                    w8a8.matmul(x, pk, sums, scale, prefetch=prefetch)

            times = rounds({0: lambda: products(0), AHEAD: lambda: products(AHEAD)}, repeats,
                           before=lambda: evict.add_(1))
            hardware, ahead = (statistics.median(times[p]) * 1e6 for p in (0, AHEAD))
            out.append({"weights": label, "rows": q, "megabytes": round(megabytes, 1),
                        "hardware_us": round(hardware, 1), "prefetch_16k_us": round(ahead, 1),
                        "ratio": round(ahead / hardware, 2), "hardware_gb_s": round(megabytes / hardware * 1e3, 1)})
    return out


# name: (file name, measure, default rows, default repeats, title, columns, cells of a row)
PRODUCTS = {
    "w8a8": ("w8a8", measure_w8a8, (1, 2, 4, 8, 16), 50,
             "The int8 product alone: splitinfer's kernel against FBGEMM's and float32",
             ["weight", "rows", "w8a8 us", "FBGEMM us", "FBGEMM / w8a8", "float32 us"],
             lambda r: [f"{r['n']}x{r['k']}", r["rows"], r["w8a8_us"], r["fbgemm_us"], r["ratio"], r["float32_us"]]),
    "w4a8": ("w4a8", measure_w4a8, (1, 2, 4, 5, 8, 16, 32), 200,
             "The int4 product alone: splitinfer's kernel against PyTorch's",
             ["weight", "rows", "w4a8 us", "PyTorch int4 us", "PyTorch / w4a8", "w4a8 GOP/s"],
             lambda r: [f"{r['n']}x{r['k']}", r["rows"], r["w4a8_us"], r["pytorch_us"], r["ratio"], r["w4a8_gops"]]),
    "w8a8-stream": ("w8a8_stream", measure_w8a8_stream, (1, 2, 3, 4, 8), 15,
                    "The int8 product streamed from memory: hardware prefetchers against prefetcht0 16 KB ahead",
                    ["weights", "rows", "MB", "hardware prefetchers us", "prefetcht0 16 KB us", "ratio",
                     "GB/s (hardware)"],
                    lambda r: [r["weights"], r["rows"], r["megabytes"], r["hardware_us"], r["prefetch_16k_us"],
                               r["ratio"], r["hardware_gb_s"]]),
}


def run(args, log=print) -> dict:
    """`bench kernels`: the product `args.kernel` at `args.rows` (default: its own), `args.repeats` timed calls
    (rounds for w8a8-stream; 0: its own), written to OUT."""
    name, measure, default_rows, default_repeats, title, columns, cells = PRODUCTS[args.kernel]
    if not kernels.ensure():
        raise ConfigError(f"splitinfer's kernels do not run on this machine ({kernels.status()['reason']}): "
                          "nothing to compare.")
    rows = tuple(int(x) for x in args.rows.split(",")) if args.rows else default_rows
    repeats = args.repeats or default_repeats
    with pinned(0, 1):  # the record's provenance is taken inside: one thread, core 0
        torch.manual_seed(0)
        results = measure(rows, repeats)
        body = [f"One thread, core 0; random weights (seed 0); medians of {repeats} timed "
                f"{'rounds' if args.kernel == 'w8a8-stream' else 'calls'} after the warm-up.", "",
                *table(columns, [cells(r) for r in results])]
        write(Path(args.out), name, {"kernel": args.kernel, "repeats": repeats, "rows": results}, body, title=title,
              command=command_line(args), log=log)
    return {"rows": results}
