"""The int8 format's own CPU kernel: int8 weights times activations quantized to int8 per row.

w8a8.cpp (built by kernels/build.py) shares each load of the weight among four rows (eight from five rows) on
AVX512-VNNI; one to four rows leave the weight stream to the hardware prefetchers (asking for it 16 KB ahead
measured 1.17-1.29x slower streamed from memory: notes/bench/w8a8-prefetch, `splitinfer bench kernels
--kernel w8a8-stream --out notes/bench/w8a8-prefetch`). Against FBGEMM's product, which Int8Linear used alone
before, it measured 1.1-1.5x faster on SmolLM2's int8 LM head at 1-16 rows (0.74 ms at one row, 1.21 at eight)
and 1.2x from four rows on a draft head's readout, 0.9x at one and two
(notes/bench/w8a8-kernel, `splitinfer bench kernels --kernel w8a8 --out notes/bench/w8a8-kernel`). Its integer sums are
exact and its epilogue is FBGEMM's and torch._int_mm's (float(sum) * the weight row's scale, then the input
row's scale), so all three give the same bits (tests/kernels/test_w8a8.py) and each row its own.
"""

from __future__ import annotations

import torch

from .build import layout


def supports_shape(n: int, k: int) -> bool:
    return n % layout()["w8a8_cols"] == 0 and k % 4 == 0


def pack(qweight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """qweight int8 [N, K] -> (the kernel's groups int8 [G, K/4, TILES * COLS * 4], G = N / (TILES * COLS) rounded
    up, zero columns after the real ones; the column sums int32 [N]). TILES, COLS: layout.h's, read back."""
    COLS, GROUP = layout()["w8a8_cols"], layout()["w8a8_tiles"]
    n, k = qweight.shape
    groups = -(-n // (COLS * GROUP))
    padded = torch.zeros(groups * GROUP * COLS, k, dtype=torch.int8)
    padded[:n] = qweight
    # column 64g + 16c + l, input 4j + i -> group g, step j, tile c, lane l, byte i
    packed = padded.reshape(groups, GROUP, COLS, k // 4, 4).permute(0, 3, 1, 2, 4)
    return packed.reshape(groups, k // 4, GROUP * COLS * 4).contiguous(), qweight.sum(dim=1, dtype=torch.int32)


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """`pack`'s groups -> the int8 weight [n, K] they hold: pack's inverse, for readers outside the step."""
    COLS, GROUP = layout()["w8a8_cols"], layout()["w8a8_tiles"]
    groups, steps, _ = packed.shape
    weight = packed.reshape(groups, steps, GROUP, COLS, 4).permute(0, 2, 3, 1, 4)  # [G, tile, column, K/4, 4]
    return weight.reshape(groups * GROUP * COLS, steps * 4)[:n].contiguous()


def matmul(xq: torch.Tensor, packed: torch.Tensor, sums: torch.Tensor, scale: torch.Tensor,
           row_scale: torch.Tensor | None = None, prefetch: int = 0) -> torch.Tensor:
    """xq [M, K] float32 integers in -127..127 times the packed weight -> [M, N] float32: float(sum) * scale[n]
    (* row_scale[m] where given). prefetch > 0: up to four rows ask for the weight that many bytes ahead (measured
    slower than the hardware prefetchers alone, the default: w8a8.cpp)."""
    return torch.ops.splitinfer.w8a8_mm(xq, packed, sums, scale, row_scale, prefetch)


def linear(x: torch.Tensor, packed: torch.Tensor, sums: torch.Tensor, scale: torch.Tensor,
           smooth: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Int8Linear's forward in one call: x [M, K] float32 (times `smooth`) quantized per row as formats.py's
    quantize_rows, times the packed weight, the row scales applied, plus `bias` -> [M, N] float32, the bits of
    quantize_rows then `matmul` then the addition (tests/kernels/test_w8a8.py)."""
    return torch.ops.splitinfer.w8a8_linear(x, packed, sums, scale, smooth, bias)
