"""The modules that multiply by a shard's integer weights on a CPU, one class a kernel, chosen at construction.

A stored int8 or int4 linear (model/formats.py) is built as the module of the kernel that runs here
(`kernel_class`, the one place that choice is made): splitinfer's own (kernels/w8a8.py, kernels/w4a8.py)
where it runs and the shape tiles, else the maintained library's (FBGEMM's int8 product, or torch._int_mm
where this torch has no FBGEMM; PyTorch's int4 product on bfloat16 inputs). The int8 kernels give the same
bits; the int4 ones round differently, and each keeps every row's bits its own (tests/model/test_formats.py).
Loading fills the module's stored state, then `finish` readies the kernel's operands (packing). Also here:
CastLinear, a bfloat16 weight inside a float32 model. This module knows nothing of shards or GGUF files.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..errors import ModelError
from ..kernels import w4a8, w8a8
from .formats import GROUP, check_int4_shape, dequantize, has_integer_kernels, stored_format
from .rows import sharing


# --- the modules that multiply ------------------------------------------------------------------------


TINY = torch.finfo(torch.float32).tiny


def quantize_rows(x: torch.Tensor, own: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] float32 -> (float32 integers in -127..127 [..., K], float32 scale [..., 1]), each row on its
    own scale. `own`: x is a temporary of the caller's, divided in place (one allocation fewer a product)."""
    scale = x.abs().amax(dim=-1, keepdim=True).div_(127).clamp_min_(TINY)
    return (x.div_(scale) if own else x / scale).round_(), scale


def fbgemm_pack(qweight: torch.Tensor, scale: torch.Tensor):
    """qweight int8 [N, K] with its row scales [N] packed for FBGEMM's int8 product (`int8_product`), or
    None where this torch has no such kernel or it does not give `int_mm_product`'s bits on a probe (a
    saturating kernel would not). FBGEMM measured 1.5-8x faster than torch._int_mm here: one core,
    SmolLM2's 26 layers 7.0 / 6.6 / 6.8 / 7.9 ms at 1 / 2 / 4 / 8 rows against 10.4 / 13.4 / 15.0 / 16.1, and
    a 4,096-wide layer of a 7B model 8.7 / 9.1 ms at 1 / 2 rows (its bytes bound: 8.7) against 10.5 / 69.1."""
    n, k = qweight.shape
    try:
        with warnings.catch_warnings():  # quantized tensors are deprecated in PyTorch; this one lives only here
            warnings.simplefilter("ignore")
            stored = torch._make_per_channel_quantized_tensor(
                qweight, scale.double(), torch.zeros(n, dtype=torch.int64), 0)
            packed = torch.ops.quantized.linear_prepack(stored, None)
        extreme = torch.where(qweight[0] < 0, -127.0, 127.0)
        seeded = torch.randint(-127, 128, (k,), generator=torch.Generator().manual_seed(0)).float()
        probe = torch.stack((extreme, -extreme, seeded))
        ok = torch.equal(int8_product(probe, packed), int_mm_product(probe, qweight.t(), scale[None, :]))
    except (AttributeError, RuntimeError, NotImplementedError):
        return None
    return packed if ok else None


def int8_product(xq: torch.Tensor, packed) -> torch.Tensor:
    """xq [..., K] float integers in -127..127 times a `fbgemm_pack`ed weight -> float32 [..., N]: each dot
    product accumulated in int32, converted once and multiplied by its row's weight scale (the input is
    quantized with scale 1, zero point 128)."""
    return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(xq, 1.0, 128, packed)


def int_mm_product(xq: torch.Tensor, qweight_t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`int8_product` by torch._int_mm: xq [M, K], qweight_t int8 [K, N], scale [1, N] -> [M, N]."""
    return torch._int_mm(xq.to(torch.int8), qweight_t).float().mul_(scale)


class QuantLinear(nn.Module):
    """What the integer linears share: `weight`, the float32 weight they stand for, and `stored_state`, the
    state as the shard stores it (both computed on each read: for readers outside the step, such as a draft
    head copying rows of the LM head)."""

    @property
    def weight(self) -> torch.Tensor:
        return dequantize(self.stored_state())

    def stored_state(self) -> dict[str, torch.Tensor]:
        return dict(self.named_buffers())


class Int8Linear(QuantLinear):
    """y = x W^T with W int8 per output row and x quantized per row: integer products, float epilogue. The
    subclass chosen at construction (`quant_module`) is the kernel: W8A8Linear, FbgemmLinear or IntMMLinear,
    which give the same bits (tests/kernels/test_w8a8.py)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, smooth: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scale", torch.empty(out_features, dtype=torch.float32))
        self.register_buffer("smooth", torch.empty(in_features, dtype=torch.float32) if smooth else None)
        self.register_buffer("bias", torch.empty(out_features, dtype=torch.float32) if bias else None)

    def finish(self) -> None:
        """Ready the kernel's operands once the state is loaded."""
        self._scale = self.scale.float()[None, :]
        self._bias = None if self.bias is None else self.bias.float().contiguous()
        self._smooth = None if self.smooth is None else self.smooth.float().contiguous()

    def int8_weight(self) -> torch.Tensor:
        """The stored int8 weight [N, K]."""
        return self.qweight

    def stored_state(self) -> dict[str, torch.Tensor]:
        return {**dict(self.named_buffers()), "qweight": self.int8_weight()}

    def _quantized(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., K] float32 -> (its rows' integers, their scales), smoothed first where the weight was."""
        smooth = self.smooth is not None
        return quantize_rows(x * self.smooth if smooth else x, own=smooth)

    def _epilogue(self, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.bias is not None:
            y = y.add_(self._bias)
        return y if dtype == torch.float32 else y.to(dtype)


class W8A8Linear(Int8Linear):
    """Int8Linear on kernels/w8a8.py's kernel: the input smoothed, quantized, multiplied and scaled in one call.
    Its tiles hold every integer of the weight, so the stored [N, K] copy is released once they are made (one
    copy in memory, not two); `int8_weight` unpacks it for readers outside the step."""

    def finish(self) -> None:
        if self.qweight is None:  # finished already: the tiles are the weight
            return
        super().finish()
        self._w8a8 = w8a8.pack(self.qweight)
        self.qweight = None

    def int8_weight(self) -> torch.Tensor:
        return self.qweight if self.qweight is not None else w8a8.unpack(self._w8a8[0], self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x if dtype == torch.float32 else x.float()  # [..., K]
        if torch.is_grad_enabled() and x.requires_grad:  # the op has no gradient: its steps, the same kernel
            xq, sx = self._quantized(x)
            y = w8a8.matmul(xq.reshape(-1, self.in_features), *self._w8a8, self._scale.view(-1), sx.reshape(-1))
        else:
            y = w8a8.linear(x.reshape(-1, self.in_features), *self._w8a8, self._scale.view(-1), self._smooth, self._bias)
            y = y.view(*x.shape[:-1], self.out_features)
            return y if dtype == torch.float32 else y.to(dtype)
        return self._epilogue(y.view(*x.shape[:-1], self.out_features), dtype)


class FbgemmLinear(Int8Linear):
    """Int8Linear on FBGEMM's int8 product, the weight packed once (a second copy beside the stored one)."""

    def finish(self) -> None:
        super().finish()
        self._packed = fbgemm_pack(self.qweight, self.scale.float())
        if self._packed is None:
            raise ModelError("FBGEMM's int8 product did not give the expected bits on this weight; "
                             "set SPLITINFER_KERNELS=none to use torch._int_mm, and report it.")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xq, sx = self._quantized(x if dtype == torch.float32 else x.float())
        return self._epilogue(int8_product(xq, self._packed).mul_(sx), dtype)


class IntMMLinear(Int8Linear):
    """Int8Linear on torch._int_mm (a CPU whose torch has no FBGEMM), the weight read as [K, N] (a view)."""

    def finish(self) -> None:
        super().finish()
        self._qweight_t = self.qweight.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xq, sx = self._quantized(x if dtype == torch.float32 else x.float())
        y = int_mm_product(xq.reshape(-1, self.in_features), self._qweight_t, self._scale)
        return self._epilogue(y.view(*xq.shape[:-1], self.out_features).mul_(sx), dtype)


class Int4Linear(QuantLinear):
    """y = x W^T with W in 4-bit groups of 32 (scale and minimum per group). The subclass chosen at
    construction is the kernel: W4A8Linear (int8 inputs) or TorchInt4Linear (bfloat16 inputs)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        check_int4_shape(out_features, in_features)
        self.in_features, self.out_features = in_features, out_features
        groups = in_features // GROUP
        self.register_buffer("qweight", torch.empty(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scale", torch.empty(out_features, groups, dtype=torch.float32))
        self.register_buffer("min", torch.empty(out_features, groups, dtype=torch.float32))
        self.register_buffer("bias", torch.empty(out_features, dtype=torch.float32) if bias else None)

    def finish(self) -> None:
        self._bias = None if self.bias is None else self.bias.float()


class W4A8Linear(Int4Linear):
    """Int4Linear on kernels/w4a8.py's kernel: inputs quantized to int8 per group of 32, integer dot products."""

    def finish(self) -> None:
        super().finish()
        self._w4a8 = w4a8.pack(self.qweight, self.scale, self.min)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape  # [..., K]
        y = w4a8.matmul(x.reshape(-1, self.in_features).float(), self._w4a8, self.out_features)  # [M, N]
        y = y if self._bias is None else y.add_(self._bias)
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)


class TorchInt4Linear(Int4Linear):
    """Int4Linear on PyTorch's `_weight_int4pack_mm_for_cpu`, whose layout computes (q - 8) * scale + zero, so
    zero = min + 8 * scale (both rounded to bfloat16, its scale type)."""

    def finish(self) -> None:
        super().finish()
        packed = self.qweight
        q = torch.stack((packed & 0xF, packed >> 4), dim=2).reshape(self.out_features, -1).to(torch.int32)
        self._packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
        scale = self.scale.float()
        zero = self.min.float() + 8 * scale
        self._scale_zero = torch.stack((scale.t(), zero.t()), dim=2).to(torch.bfloat16).contiguous()  # [K/32, N, 2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape  # [..., K]
        xb = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self._packed, GROUP, self._scale_zero)  # [M, N]
        if self._bias is not None:
            y = y + self._bias.to(y.dtype)
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)


def kernel_class(fmt: str, in_features: int, out_features: int) -> type:
    """The module that multiplies by an `fmt` ('int8'/'int4') weight [out, in] on this machine's CPU: splitinfer's
    kernel where it runs (kernels.runs) and fits the shape, else the maintained library's. The one place a
    product's kernel is chosen."""
    if fmt == "int8":
        if kernels.runs("w8a8") and w8a8.supports_shape(out_features, in_features):
            return W8A8Linear
        return FbgemmLinear if fbgemm_works() else IntMMLinear
    if kernels.runs("w4a8") and w4a8.supports_shape(out_features, in_features):
        return W4A8Linear
    return TorchInt4Linear


@functools.cache
def fbgemm_works() -> bool:
    """Whether FBGEMM's int8 product is in this torch and gives `int_mm_product`'s bits (a probe weight). The
    probe runs on the CPU whatever the default device where it is first asked (modules are chosen while a
    shard's skeleton is built on the meta device, where the probe would fail and its answer stay cached)."""
    with torch.device("cpu"):
        qweight = torch.randint(-127, 128, (16, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
        return fbgemm_pack(qweight, torch.rand(16, generator=torch.Generator().manual_seed(1)) + 0.01) is not None


def select_rows(linear: nn.Module, index: torch.Tensor) -> QuantLinear | None:
    """Output rows `index` of an int8/int4 linear as a linear of their own in the same format (the stored
    integers and scales taken as they are, not quantized again), or None for any other module: a draft
    head's readout is rows of the LM head (model/drafthead.py)."""
    if isinstance(linear, Int8Linear):
        rows = type(linear)(linear.in_features, len(index), bias=linear.bias is not None, smooth=linear.smooth is not None)
        names = ("qweight", "scale", "bias")
        rows.smooth = linear.smooth
    elif isinstance(linear, Int4Linear):
        rows = type(linear)(linear.in_features, len(index), bias=linear.bias is not None)
        names = ("qweight", "scale", "min", "bias")
    else:
        return None
    state = linear.stored_state()
    for name in names:
        if name in state:
            setattr(rows, name, state[name][index].contiguous())
    rows.finish()
    return rows


class CastLinear(nn.Linear):
    """A bfloat16 nn.Linear inside a model that computes in another dtype: its input cast in, output out."""

    @classmethod
    def of(cls, linear: nn.Linear) -> "CastLinear":
        """A CastLinear holding `linear`'s own parameters (not copies)."""
        return sharing(cls, linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)
        return y if self.bias is None else y + self.bias


def quant_module(fmt: str, in_features: int, out_features: int, bias: bool, smooth: bool = False) -> QuantLinear:
    """The module for a stored `fmt` weight, its kernel chosen here (`kernel_class`); its state still to load."""
    cls = kernel_class(fmt, in_features, out_features)
    if fmt == "int8":
        return cls(in_features, out_features, bias=bias, smooth=smooth)
    return cls(in_features, out_features, bias=bias)


def construct_quantized(module: nn.Module, weights: dict[str, torch.Tensor]) -> nn.Module:
    """`module` (meta device, state not loaded) with every nn.Linear whose weight is stored quantized replaced
    by the module that multiplies by it here (`quant_module`); returns `module`, or its replacement where it
    is itself such a linear (an LM head)."""
    for name, child in list(module.named_modules()):
        fmt = stored_format(weights, name + "." if name else "") if type(child) is nn.Linear else None
        if fmt is None:
            continue
        smooth = (name + ".smooth" if name else "smooth") in weights
        with torch.device("meta"):
            made = quant_module(fmt, child.in_features, child.out_features, child.bias is not None, smooth=smooth)
        if not name:
            return made
        parent_name, _, attr = name.rpartition(".")
        setattr(module.get_submodule(parent_name) if parent_name else module, attr, made)
    return module


def finish(module: nn.Module, device: torch.device | str) -> None:
    """Ready every quantized linear of a loaded module; refuse devices without the kernels."""
    quantized = [m for m in module.modules() if isinstance(m, QuantLinear)]
    if quantized and not has_integer_kernels(device):  # materialize dequantizes first (for_device)
        raise ModelError(f"int8/int4 modules reached {device}, whose products are CPU kernels; load the shard "
                         "through model/shards.py, which gives other devices the float weights.")
    for m in quantized:
        m.finish()


def is_float_state(name: str, module: nn.Module) -> bool:
    """False for the integer state and scales of a quantized linear (never cast to the compute dtype)."""
    owner = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
    return not isinstance(owner, QuantLinear)
