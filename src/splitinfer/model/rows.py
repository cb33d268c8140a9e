"""Weight products of a decode step on a CPU: oneDNN with the weight packed once, not per call.

A decode step multiplies q rows (the root, and q - 1 draft nodes when speculating) by every weight
matrix; on a CPU the step is bound by streaming those weights from memory. `F.linear` hands each product
to MKL's sgemm, which for a few rows repacks the weight into its blocked layout on every call (26 SmolLM2
layers in plain transformers, one core: 75.7 / 87.3 / 91.8 ms for 4 / 8 / 16 rows against 49.0 for one;
notes/bench/step). oneDNN's linear takes a weight reordered into its own layout
once (`torch.ops.mkldnn._reorder_linear_weight`, the kernel `torch.compile` uses for CPU linears), so a
step of any row count streams each weight once, as a product should. Blocks of one to three rows stay
with `F.linear` (`PACKED_MIN_ROWS`), as plain transformers runs them. `splitinfer bench step` measures
whole steps both ways against plain transformers.

The packed copy is made on the first CPU forward and remade whenever the weight changes in place or is
replaced (privatization, tensor-parallel slicing and tests edit weights after loading), so the module's
`weight` stays the one source of truth and its state dict is unchanged. It costs one more copy of the
weights in memory on the CPU. Other devices, dtypes other than float32/bfloat16, autograd and a torch
build without oneDNN keep `F.linear`.

Both kernels compute the same dot products in another order, so float32 results differ in the last bits
(about 6e-5 on values of magnitude 10); a block of q rows already differed from q single rows. Exactness
against sequential decoding is measured, as always, on token ids.

History (kept because it misled once): until this module the CPU path was `weight @ x.T` for 1-4 rows
("few-rows form"). A kernel micro-benchmark favoured it; the issue that removed it measured the whole
local-only step doubled by it, while plain transformers, which calls `F.linear`, did not slow. A
micro-benchmark never decides alone: `bench step` times the whole step against the anchor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PACKED_DTYPES = (torch.float32, torch.bfloat16)
# Below four rows `F.linear` (MKL; for one row a matrix-vector product at the bandwidth limit; what plain
# transformers runs) measured faster in the whole step than oneDNN's packed product: 26 layers on one core,
# 59.0 / 62.6 against 64.0 / 71.7 ms for two / three rows (notes/bench/step-rows2-3). From four rows the
# packed product wins (notes/bench/step: 67.3 against 75.7 ms at four, 77.2 against 87.3 at eight).
PACKED_MIN_ROWS = 4


def _onednn_linear_available() -> bool:
    ops = torch.ops.mkldnn
    return torch.backends.mkldnn.is_available() and all(
        hasattr(ops, name) for name in ("_reorder_linear_weight", "_linear_pointwise")
    )


ONEDNN = _onednn_linear_available()


def packs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when x @ weight.T takes oneDNN's packed linear (CPU, float32/bfloat16, 4+ rows, no autograd)."""
    return (
        ONEDNN
        and x.device.type == "cpu"
        and x.numel() >= PACKED_MIN_ROWS * x.shape[-1]
        and x.dtype == weight.dtype
        and weight.dtype in PACKED_DTYPES
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] reordered into oneDNN's blocked layout (an opaque mkldnn tensor)."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] times a `pack`ed weight -> [..., out], contiguous."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def sharing(cls: type, linear: nn.Linear) -> nn.Linear:
    """A `cls` (an nn.Linear subclass) built around `linear`'s own parameters, not copies: a float linear's
    module chosen at load."""
    made = cls.__new__(cls)
    nn.Module.__init__(made)
    made.in_features, made.out_features = linear.in_features, linear.out_features
    made.weight, made.bias = linear.weight, linear.bias
    return made


class RowsLinear(nn.Linear):
    """nn.Linear whose CPU forward runs oneDNN on a packed copy of `weight` from four rows (below, F.linear: MKL's
    matrix-vector product, what plain transformers runs); same parameters and state dict."""

    @classmethod
    def of(cls, linear: nn.Linear) -> "RowsLinear":
        """A RowsLinear holding `linear`'s own parameters (not copies)."""
        return sharing(cls, linear)

    _packed: torch.Tensor | None = None
    _packed_of: tuple | None = None  # (storage pointer, version, dtype, shape) the copy was made from

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Under torch.compile (LayerStack.compile_passes) inductor packs the weights itself.
        if torch.compiler.is_compiling() or not packs(x, self.weight):
            return F.linear(x, self.weight, self.bias)
        return packed_linear(x, self.packed_weight(), self.bias)

    def __getstate__(self) -> dict:
        # The packed copy is opaque (no storage): copies and pickles drop it and repack on first use.
        state = super().__getstate__()
        state.pop("_packed", None), state.pop("_packed_of", None)
        return state

    def packed_weight(self) -> torch.Tensor:
        w = self.weight
        key = (w.data_ptr(), _version(w), w.dtype, tuple(w.shape))
        if self._packed_of != key:
            self._packed, self._packed_of = pack(w), key
        return self._packed


def _version(t: torch.Tensor) -> int:
    # Inference tensors keep no version counter; an in-place edit of one is not seen (nothing does one).
    return -1 if t.is_inference() else t._version


def use_row_kernels(module: nn.Module) -> nn.Module:
    """`module` with every plain nn.Linear inside it replaced by a RowsLinear on the same parameters; returns
    `module`, or its replacement where it is itself a plain nn.Linear."""
    if type(module) is nn.Linear:
        return RowsLinear.of(module)
    replace_children(module, lambda child: RowsLinear.of(child) if type(child) is nn.Linear else None)
    return module


def replace_children(module: nn.Module, make) -> int:
    """Every submodule below `module` for which `make(child)` returns a module is replaced by it, in its
    parent's place (a module held in several places is replaced in each); returns how many."""
    done = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            made = make(child)
            if made is not None:
                setattr(parent, name, made)
                done += 1
    return done

