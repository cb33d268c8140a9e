"""Matrix products over a few rows on a CPU: the shape of every decode step.

A decode step multiplies q rows (the root, and q - 1 draft nodes when speculating) by every weight
matrix. On the CPU build of torch (MKL), `F.linear` with 2 or 3 rows runs about one matrix-vector
product per row, so the whole weight streams from memory once per row, and its one-row product is
slower than a two-column matrix product. Written as weight @ x.T (one row padded to two), the weight
streams once for a few rows. `splitinfer bench-kernels` measures both forms on the machine at hand;
on this project's 2-core CPU (docs/bench/kernels/, one thread) SmolLM2-135M's LM head costs
F.linear 11 / 23 / 37 / 20 ms for q = 1 / 2 / 3 / 4 rows and the few-rows form 8 / 9 / 9 / 11 ms,
its 30 layers 43 / 68 / 80 / 56 ms against 39 / 32 / 49 / 50 ms; from 5 rows on F.linear is as fast
or faster (layers 56 against 60 ms, 68 against 93 at 6), so only q <= `SMALL_ROWS_MAX` take the
few-rows form. With two threads (docs/bench/kernels-2threads/) the one-row product gains most (layers
41 -> 26 ms, LM head 11 -> 4 ms), because MKL runs its matrix-vector product on one thread.

Both forms compute the same dot products in a different order, so their float32 results differ in the
last bits (about 4e-5 on logits of magnitude 10-30), as a block of q rows already differs from q single
rows; exactness against sequential decoding is measured, as it always was, by comparing token ids.
Only float32 on the CPU is rerouted: other devices and dtypes keep `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SMALL_ROWS_MAX = 4  # rows up to which the few-rows form beats F.linear on one thread (measured, docstring)


def small_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when x [..., in] times `weight` [out, in] takes the few-rows form."""
    rows = x.numel() // max(x.shape[-1], 1)
    return 1 <= rows <= SMALL_ROWS_MAX and x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through weight @ x.T when x has a few rows (module docstring)."""
    if not small_rows(x, weight):
        return F.linear(x, weight, bias)
    out = few_rows_product(x.reshape(-1, x.shape[-1]), weight)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def few_rows_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [rows, in] -> x @ weight.T [rows, out], computed as weight @ x.T; a single row is padded to two
    (MKL's two-column product beats its matrix-vector one). Contiguous, so callers may .view() it."""
    rows = x.shape[0]
    if rows == 1:
        x = torch.cat([x, x.new_zeros(1, x.shape[1])])
    return (weight @ x.T).T[:rows].contiguous()


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
