"""The int8 format's own CPU kernel: int8 weights times activations quantized to int8 per row.

Where the CPU has AMX-INT8 (and the input length is whole chunks of 64), w8a8_amx.cpp multiplies on tiles, up to
sixteen rows a pass with one read of the weight: a 7B trusted half's step at 1-16 rows then streams its weights
like a one-row step (notes/bench/amx-7b). The paragraph below is the AVX-512 VNNI path, which runs elsewhere;
both give the same bits.

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
    up, zero columns after the real ones; the column sums int32 [N]). In a group, chunks of DEPTH inputs (fewer in
    the last), each the TILES tiles' [steps, COLS, 4] one after the other (layout.h). Read back from the library."""
    cols, tiles, chunk = layout()["w8a8_cols"], layout()["w8a8_tiles"], layout()["w8a8_depth"] // 4
    n, k = qweight.shape
    groups = -(-n // (cols * tiles))
    padded = torch.zeros(groups * tiles * cols, k, dtype=torch.int8)
    padded[:n] = qweight
    # column 64g + 16c + l, input 4j + i -> group g, step j, tile c, lane l, byte i; then each chunk's steps
    # and tiles swapped, so a tile's chunk lies in one piece
    steps = padded.reshape(groups, tiles, cols, k // 4, 4).permute(0, 3, 1, 2, 4)
    chunks = [steps[:, j:j + chunk].transpose(1, 2).reshape(groups, -1) for j in range(0, k // 4, chunk)]
    return torch.cat(chunks, dim=1).reshape(groups, k // 4, tiles * cols * 4), qweight.sum(dim=1, dtype=torch.int32)


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """`pack`'s groups -> the int8 weight [n, K] they hold: pack's inverse, for readers outside the step."""
    cols, tiles, chunk = layout()["w8a8_cols"], layout()["w8a8_tiles"], layout()["w8a8_depth"] // 4
    groups, k4, _ = packed.shape
    flat = packed.reshape(groups, -1)
    steps = [flat[:, j * tiles * cols * 4:(j + size) * tiles * cols * 4].reshape(groups, tiles, size, cols, 4)
             for j, size in ((j, min(chunk, k4 - j)) for j in range(0, k4, chunk))]
    weight = torch.cat(steps, dim=2).permute(0, 1, 3, 2, 4)  # [G, tile, column, K/4, 4]
    return weight.reshape(groups * tiles * cols, k4 * 4)[:n].contiguous()


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
