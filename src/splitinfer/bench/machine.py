"""What this machine can do on the threads a step runs, measured: memory read bandwidth and the products' peaks.

`bench step` sets each step beside the two limits a step can hit (a roofline): streaming the weights and
the cached keys/values from memory, and the multiply-adds of the weight products. Both are measured here
on the threads and cores the step runs on (torch's thread count: every probe runs on all of them at once),
never taken from a datasheet.
"""

from __future__ import annotations

import statistics

import torch

from .. import kernels
from ..model import arena
from .harness import cpu_flags, timed  # noqa: F401  (cpu_flags: step.py and formats.py read it here)

PEAK_SIZE = 1024  # n of the n x n x n product that measures the peak: compute-bound, and in cache blocks


def kernels_line(report: dict) -> str:
    """A report's 'kernels' entry (kernels.report()) as one phrase; PyTorch's before it existed."""
    return ", ".join(f"{part}: {name}" for part, name in report.get("kernels", {}).items()) or "PyTorch's"


def _median_s(run, repeats: int) -> float:
    return statistics.median(timed(run, repeats))  # one warm-up call first


def bandwidth_gbps(repeats: int = 5) -> float:
    """Read bandwidth on torch's threads: a 1 GiB float32 buffer summed, median of `repeats`, in ordinary 4 KB pages
    and again moved into transparent huge pages as the integer weights are (model/arena.py); the higher of the
    two, so that no step's weights can stream faster than its bound says."""
    buf = torch.ones(1 << 28)
    plain = buf.numel() * 4 / _median_s(buf.sum, repeats) / 1e9
    if not arena.gather([buf]):  # no anonymous mappings here, or SPLITINFER_ARENA=0
        return plain
    return max(plain, buf.numel() * 4 / _median_s(buf.sum, repeats) / 1e9)


def product_gflops(dtype: torch.dtype = torch.float32, repeats: int = 5) -> float:
    """The float product peak in `dtype` on torch's threads: a square PEAK_SIZE product (2 n^3 flops), GFLOP/s, median."""
    a = torch.randn(PEAK_SIZE, PEAK_SIZE, generator=torch.Generator().manual_seed(0)).to(dtype)
    b = torch.randn(PEAK_SIZE, PEAK_SIZE, generator=torch.Generator().manual_seed(1)).to(dtype)
    return 2 * PEAK_SIZE**3 / _median_s(lambda: a @ b, repeats) / 1e9


def int8_dot_gops(repeats: int = 5) -> float | None:
    """The VNNI int8 dot-product peak on torch's threads (kernels/probe.cpp's int8_dot_peak: the instruction the
    int4 kernel, and the int8 one without AMX, multiply with), GOP/s, median of `repeats` runs of ~0.1 s; None
    where those kernels do not run."""
    if not kernels.available():
        return None
    torch.ops.splitinfer.int8_dot_peak(1_000_000)  # warm-up
    return statistics.median(torch.ops.splitinfer.int8_dot_peak(30_000_000) for _ in range(repeats))


def amx_gops(repeats: int = 5) -> float | None:
    """The AMX int8 peak on torch's threads (w8a8_amx.cpp's amx_peak: tdpbusd, what the int8 product multiplies
    with where `kernels.runs("amx")`), GOP/s, median of `repeats` runs of ~0.1 s; None where AMX does not run."""
    if not kernels.runs("amx"):
        return None
    torch.ops.splitinfer.amx_peak(10_000)  # warm-up (and the first use's grant of the tile state)
    return statistics.median(torch.ops.splitinfer.amx_peak(400_000) for _ in range(repeats))
