"""The int4 format's own CPU kernel: 4-bit weights times activations quantized to int8 in groups of 32.

PyTorch's `_weight_int4pack_mm_for_cpu` multiplies in float (bfloat16 inputs): from four rows it runs at
the core's float peak (91 GFLOP/s of 100 at 4 and 8 rows: notes/bench/step-int4-rows as of commit
72c53aa), so a verification step of a tree costs 2-4x a one-row step; this kernel runs 3.7-5.3x faster
(notes/bench/w4a8-kernel, `splitinfer bench kernels --kernel w4a8`). No maintained PyTorch or torchao CPU kernel multiplies 4-bit
weights by integer activations on x86 (`_dyn_quant_matmul_4bit` falls back to float there), so this one is
ours: w4a8.cpp (built by kernels/build.py), the recipe llama.cpp uses for a Q4_1 GGUF (Q8_1 activations,
integer dot products on AVX512-VNNI). See w4a8.cpp for the math.

Each row's activations are quantized on their own, in blocks of 32 (scale = max |x| / 127), and each
block's integer sum is exact, so a row's bits do not depend on the other rows of the call: the kernel is
row-invariant by construction, and tests/kernels/test_w4a8.py checks it bitwise at 1-64 rows.

Where kernels/build.py's kernels do not run, int4 uses PyTorch's kernel (other rounding, also row-invariant:
tests/model/test_formats.py).
"""

from __future__ import annotations

import torch

from .build import layout

GROUP = 32  # inputs a block: GGUF's Q4_1 and Q8_1, the stored int4 format's (model/formats.py); layout.h's too


def pack(qweight: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """The stored int4 state (qweight uint8 [N, K/2], even inputs in the low nibbles; scale and min [N, K/32])
    -> the kernel's tiles, uint8 [N/16, K/32, 320]. Scales and minima become float16, which a GGUF's are."""
    COLS = layout()["w4a8_cols"]
    assert layout()["w4a8_group"] == GROUP and layout()["w4a8_tile_bytes"] == COLS * GROUP // 2 + 4 * COLS
    n = qweight.shape[0]
    q = torch.stack((qweight & 0xF, qweight >> 4), dim=2).reshape(n, -1)  # [N, K], values 0..15
    k = q.shape[1]
    tiles, blocks = n // COLS, k // GROUP
    # input 32b + 16h + 4j + i of column c -> vector j, lane c, byte i, nibble h
    q = q.reshape(tiles, COLS, blocks, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)  # [T, B, j, c, i, h]
    nibbles = (q[..., 0] | (q[..., 1] << 4)).reshape(tiles, blocks, -1)  # [T, B, 256]
    halves = torch.stack((scale, minimum)).to(torch.float16).reshape(2, tiles, COLS, blocks)
    halves = halves.permute(1, 3, 0, 2).contiguous().view(torch.uint8).reshape(tiles, blocks, -1)  # [T, B, 64]
    return torch.cat((nibbles, halves), dim=2).contiguous()


def supports_shape(n: int, k: int) -> bool:
    return n % layout()["w4a8_cols"] == 0 and k % GROUP == 0


def matmul(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """x [M, K] float32 times the packed weight -> [M, n] float32 (the library loaded)."""
    return torch.ops.splitinfer.w4a8_mm(x, packed, n)


def reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """The kernel's math in float64 PyTorch (tests): activations quantized per block of 32, half-even."""
    x = x.double()
    m, k = x.shape
    xb = x.reshape(m, k // GROUP, GROUP)
    amax = xb.abs().amax(dim=2, keepdim=True).float()
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    qx = torch.round(xb.float() * inv).double()  # [M, B, 32]
    dx = (amax / 127).double()
    q = torch.stack((qweight & 0xF, qweight >> 4), dim=2).reshape(qweight.shape[0], -1).double()
    qb = q.reshape(q.shape[0], k // GROUP, GROUP)  # [N, B, 32]
    d = scale.to(torch.float16).double()  # [N, B]
    mn = minimum.to(torch.float16).double()
    dots = torch.einsum("mbi,nbi->mnb", qx, qb)  # exact integers
    sx = dx[..., 0] * qx.sum(dim=2)  # [M, B]
    return (dots * dx[..., 0][:, None, :] * d[None] + mn[None] * sx[:, None, :]).sum(dim=2)
