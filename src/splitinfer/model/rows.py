"""Matrix products over a few rows on a CPU: the shape every speculative block has.

A decode step multiplies q rows (the root and q - 1 draft nodes) by every weight matrix. On the CPU
build of torch (MKL), `F.linear` with 2 or 3 rows runs about one matrix-vector product per row, so the
whole weight streams from memory once per row. On this project's 2-core CPU, one thread
(docs/bench/kernels/, `splitinfer bench-kernels`), SmolLM2-135M's 30 layers cost 41 / 65 / 78 / 57 ms
for q = 1 / 2 / 3 / 4 rows and its LM head 11 / 25 / 37 / 20 ms; written as weight @ x.T, the product
streams the weight once for a few rows: the layers 44 / 30 / 41 / 51 ms, the LM head 11 / 9 / 12 / 11
ms. From 5 rows on the ordinary path is faster again (layers 62 against 73 ms), so only
2 <= q <= `SMALL_ROWS_MAX` take the other form; with two threads the layers cross over at the same
row count (docs/bench/kernels-2threads/).

Both forms compute the same dot products in a different order, so their float32 results differ in the
last bits (about 4e-5 on logits of magnitude 10-30), as a block of q rows already differs from q single
rows; exactness against sequential decoding is measured, as it always was, by comparing token ids.
Only float32 on the CPU is rerouted: other devices and dtypes keep `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SMALL_ROWS_MAX = 4  # rows up to which weight @ x.T beats F.linear on one thread (measured, docstring)


def small_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when x [..., in] times `weight` [out, in] takes the few-rows form."""
    rows = x.numel() // max(x.shape[-1], 1)
    return 2 <= rows <= SMALL_ROWS_MAX and x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through weight @ x.T when x has a few rows (module docstring)."""
    if not small_rows(x, weight):
        return F.linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1])  # [rows, in]
    out = (weight @ flat.T).T.contiguous()  # [rows, out]; contiguous so callers may .view() it
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


class RowsLinear(nn.Linear):
    """nn.Linear whose forward is `linear` above; same parameters and state dict."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def use_row_kernels(module: nn.Module) -> nn.Module:
    """Switch every plain nn.Linear inside `module` (itself included) to RowsLinear, in place."""
    for sub in module.modules():
        if type(sub) is nn.Linear:
            sub.__class__ = RowsLinear
    return module
