"""Weight formats: how a shard stores its linear layers and which CPU kernel multiplies by them.

A decode step streams every weight once, so its floor is the weights' bytes over memory bandwidth. A
shard's decoder layers and LM head are each stored in one of four formats:

    float32   4 bytes a weight; nn.Linear (model/rows.py's packed kernel from four rows)
    bfloat16  2 bytes a weight; nn.Linear in bfloat16, its input and output cast around it
    int8      1 byte a weight, one float32 scale per output row; the input is quantized per row to int8
              (symmetric, scale = max |x| / 127) and multiplied by FBGEMM's int8 product on a weight packed
              once (`torch._int_mm` where FBGEMM is not there): integer accumulation, so every row gets the
              same bits whatever else is in the block
    int4      half a byte a weight in groups of 32 along the input, each with a float16 scale and minimum
              (GGUF's Q4_1 layout: w = d * q + m, q in 0..15); on AVX512-VNNI our own kernel with the
              input quantized to int8 per group of 32 (model/w4a8.py, llama.cpp's recipe for Q4_1), else
              PyTorch's `_weight_int4pack_mm_for_cpu` on bfloat16 inputs (a float kernel: its row
              invariance is tested bitwise, tests/model/test_formats.py, not assumed)

Integer formats keep their state under `qweight`, `scale` (and `min` for int4) in the shard, and the
module that multiplies by them is swapped in when the shard is loaded (`install`). Only the CPU has
these kernels here; a quantized shard refuses to load on another device with a sentence saying what to
prepare instead. This module knows nothing of GGUF files (model/gguf_blocks.py reads their blocks) nor of
shards (model/prepare.py chooses a format per part).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, ModelError
from . import w4a8, w8a8

FORMATS = ("float32", "bfloat16", "int8", "int4")
PARTS = ("local", "cloud", "lm_head")  # local decoder layers, cloud decoder layers, the LM head
GROUP = 32  # int4 group size along the input dimension (GGUF's Q4_0/Q4_1 block)
QUANTIZED = ("int8", "int4")
# SmoothQuant's migration strength for int8: 0.7 measured best of 0.5 / 0.7 / 0.85 on SmolLM2-135M
# (perplexity of held-out prompts, layers in int8, LM head float32: +2.8% / +0.4% / +2.3%; 0 gives +4.8%).
SMOOTH_ALPHA = 0.7


@dataclass(frozen=True)
class WeightFormats:
    """The format of each part of a prepared model (`prepare --weights`)."""

    local: str = "float32"  # decoder layers on the trusted side
    cloud: str = "float32"  # decoder layers on the untrusted side
    lm_head: str = "float32"  # the LM head (the embedding itself is always stored as float: one row a token)

    def __post_init__(self):
        for part in PARTS:
            if getattr(self, part) not in FORMATS:
                raise ConfigError(f"--weights: {part} format {getattr(self, part)!r} is not one of {', '.join(FORMATS)}.")

    @classmethod
    def parse(cls, text: str) -> "WeightFormats":
        """'int8' (every part), or entries 'FORMAT' and 'PART=FORMAT' separated by commas, later ones
        winning: 'int4,lm_head=int8' -> layers int4 on both sides, LM head int8."""
        chosen: dict[str, str] = {}
        for entry in (e.strip() for e in text.split(",")):
            part, sep, fmt = entry.partition("=")
            if not sep:
                chosen.update({p: entry for p in PARTS})
            elif part.strip() in PARTS:
                chosen[part.strip()] = fmt.strip()
            else:
                raise ConfigError(f"--weights: {part.strip()!r} is not a part; name one of {', '.join(PARTS)} "
                                  f"(e.g. --weights int4,lm_head=int8).")
        missing = [p for p in PARTS if p not in chosen]
        if missing:
            raise ConfigError(f"--weights {text!r} leaves {', '.join(missing)} unset; start with a format for "
                              "every part (e.g. --weights int8,cloud=int4).")
        return cls(**chosen)

    def as_dict(self) -> dict:
        return {part: getattr(self, part) for part in PARTS}

    def spec(self) -> str:
        """The shortest `--weights` text for these formats."""
        values = set(self.as_dict().values())
        if len(values) == 1:
            return self.local
        return ",".join(f"{part}={fmt}" for part, fmt in self.as_dict().items())


# --- quantizing float weights -------------------------------------------------------------------------


def quantize_int8(weight: torch.Tensor, act_max: torch.Tensor | None = None,
                  column_max: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """weight [N, K] float -> {qweight int8 [N, K], scale float32 [N]}: symmetric, per output row.

    With `act_max` [K] (the largest |input| seen per input channel on calibration text) the difficulty of
    quantizing is moved from the inputs to the weight (SmoothQuant, arXiv 2211.10438): channel k of the
    weight is multiplied by s_k = act_max_k^a / max|W[:, k]|^(1 - a) and the input divided by it
    (`smooth` = 1 / s, applied before the input is quantized), the same product in exact arithmetic.
    A few input channels of these models carry values hundreds of times the rest; quantized per row
    as they are, they leave the other channels a handful of levels. `column_max` [K] replaces max|W[:, k]|
    with the maximum over every weight sharing this input (model/fused.py: the siblings then share one
    `smooth`, so one quantized input serves their fused product)."""
    w = weight.detach().float()
    smooth = None
    if act_max is not None:
        tiny = 1e-5
        column_max = w.abs().amax(dim=0) if column_max is None else column_max.float()
        s = act_max.float().clamp_min(tiny) ** SMOOTH_ALPHA / column_max.clamp_min(tiny) ** (1 - SMOOTH_ALPHA)
        w, smooth = w * s[None, :], (1 / s)
    scale = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    state = {"qweight": q.contiguous(), "scale": scale.contiguous()}
    if smooth is not None:
        state["smooth"] = smooth.contiguous()
    return state


def quantize_int4(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """weight [N, K] float -> int4 state with groups of 32 along K (Q4_1's recipe: d = (max - min) / 15,
    m = min, both rounded to float16, q = round((w - m) / d))."""
    n, k = weight.shape
    check_int4_shape(n, k)
    w = weight.detach().float().reshape(n, k // GROUP, GROUP)
    low, high = w.amin(dim=2), w.amax(dim=2)
    low = low.half().float()  # d and m are float16, as in a GGUF (and in model/w4a8.py's kernel)
    d = ((high - low) / 15).half().float()
    step = d.clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round((w - low[..., None]) / step[..., None]).clamp_(0, 15).to(torch.uint8).reshape(n, k)
    return int4_state(q, d, low)


def int4_state(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> dict[str, torch.Tensor]:
    """q uint8 [N, K] in 0..15, d and m [N, K / 32] -> the stored int4 state (two values a byte, the even
    column in the low nibble)."""
    q = q.to(torch.uint8)
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
    return {"qweight": packed, "scale": d.float().contiguous(), "min": m.float().contiguous()}


def check_int4_shape(n: int, k: int) -> None:
    if k % GROUP:
        raise ModelError(f"int4 needs an input size divisible by {GROUP}; this layer has {k}. Use int8 or bfloat16.")


def quantize(weight: torch.Tensor, fmt: str, act_max: torch.Tensor | None = None,
             column_max: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The state a linear weight [N, K] is stored as in `fmt` (float formats: {'weight': cast}); `act_max`,
    `column_max`: int8's calibration (`quantize_int8`)."""
    if fmt == "int8":
        return quantize_int8(weight, act_max, column_max)
    if fmt == "int4":
        return quantize_int4(weight)
    return {"weight": weight.detach().to(getattr(torch, fmt)).contiguous().clone()}


def dequantize(state: dict[str, torch.Tensor]) -> torch.Tensor:
    """The float32 weight [N, K] a stored state stands for (reference computations, tests)."""
    if "min" in state:
        packed = state["qweight"]
        q = torch.stack((packed & 0xF, packed >> 4), dim=2).reshape(packed.shape[0], -1).float()
        n, k = q.shape
        w = q.reshape(n, k // GROUP, GROUP) * state["scale"][..., None] + state["min"][..., None]
        return w.reshape(n, k)
    if "qweight" in state:
        w = state["qweight"].float() * state["scale"][:, None]
        return w * state["smooth"][None, :] if "smooth" in state else w
    return state["weight"].float()


def dequantized_state(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A shard's state with every int8/int4 linear replaced by '<prefix>weight', its float32 weight."""
    out = dict(weights)
    for key in [k for k in weights if k.endswith("qweight")]:
        prefix = key[: -len("qweight")]
        state = {name: out.pop(prefix + name) for name in ("qweight", "scale", "min", "smooth") if prefix + name in out}
        out[prefix + "weight"] = dequantize(state)
    return out


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
    """y = x W^T with W int8 per output row and x quantized per row: integer products, float epilogue."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, smooth: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scale", torch.empty(out_features, dtype=torch.float32))
        self.register_buffer("smooth", torch.empty(in_features, dtype=torch.float32) if smooth else None)
        self.register_buffer("bias", torch.empty(out_features, dtype=torch.float32) if bias else None)

    def finish(self) -> None:
        """Ready the kernel's operands after the state is loaded: model/w8a8.py's tiles where that kernel
        runs, else the weight packed for FBGEMM (a second copy), or as [K, N] (a view) for `torch._int_mm`
        where FBGEMM is not there. All three give the same bits. The tiles hold every integer of the weight,
        so where they are made the stored [N, K] copy is released: one copy of the weight in memory, not two
        (`int8_weight` unpacks it for the readers outside the step)."""
        if self.qweight is None:  # finished already: the tiles are the weight
            return
        self._scale = self.scale.float()[None, :]
        self._bias = None if self.bias is None else self.bias.float().contiguous()
        self._smooth = None if self.smooth is None else self.smooth.float().contiguous()
        self._w8a8 = self._packed = self._qweight_t = None
        cpu = self.qweight.device.type == "cpu"
        if cpu and w8a8.supports_shape(self.out_features, self.in_features) and w8a8.available():
            self._w8a8 = w8a8.pack(self.qweight)
            self.qweight = None
            return
        self._qweight_t = self.qweight.t()
        if cpu:
            self._packed = fbgemm_pack(self.qweight, self.scale.float())

    def int8_weight(self) -> torch.Tensor:
        """The stored int8 weight [N, K]: the buffer, or the kernel's tiles unpacked once `finish` released it."""
        return self.qweight if self.qweight is not None else w8a8.unpack(self._w8a8[0], self.out_features)

    def stored_state(self) -> dict[str, torch.Tensor]:
        return {**dict(self.named_buffers()), "qweight": self.int8_weight()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x if dtype == torch.float32 else x.float()  # [..., K]
        if self._w8a8 is not None and not (torch.is_grad_enabled() and x.requires_grad):  # one native call
            y = w8a8.linear(x.reshape(-1, self.in_features), *self._w8a8, self._scale.view(-1), self._smooth, self._bias)
            y = y.view(*x.shape[:-1], self.out_features)
            return y if dtype == torch.float32 else y.to(dtype)
        smooth = self.smooth is not None
        xq, sx = quantize_rows(x * self.smooth if smooth else x, own=smooth)
        if self._w8a8 is not None:  # the row scales applied in the kernel
            y = w8a8.matmul(xq.reshape(-1, self.in_features), *self._w8a8, self._scale.view(-1), sx.reshape(-1))
            y = y.view(*xq.shape[:-1], self.out_features)
        elif self._packed is not None:
            y = int8_product(xq, self._packed).mul_(sx)
        else:
            y = int_mm_product(xq.reshape(-1, self.in_features), self._qweight_t, self._scale)
            y = y.view(*xq.shape[:-1], self.out_features).mul_(sx)  # [..., N]
        if self.bias is not None:
            y = y.add_(self._bias)
        return y if dtype == torch.float32 else y.to(dtype)


class Int4Linear(QuantLinear):
    """y = x W^T with W in 4-bit groups of 32 (scale and minimum per group): model/w4a8.py's kernel on
    int8 inputs where it runs, else PyTorch's on bfloat16 inputs."""

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
        """Pack the weight for the kernel that runs here: model/w4a8.py's where it is available (this CPU
        has AVX512-VNNI and it was built), else PyTorch's, whose layout computes (q - 8) * scale + zero, so
        zero = min + 8 * scale (both rounded to bfloat16, its scale type)."""
        self._bias = None if self.bias is None else self.bias.float()
        self._w4a8 = None
        if w4a8.supports_shape(self.out_features, self.in_features) and w4a8.available():
            self._w4a8 = w4a8.pack(self.qweight, self.scale, self.min)
            return
        packed = self.qweight
        q = torch.stack((packed & 0xF, packed >> 4), dim=2).reshape(self.out_features, -1).to(torch.int32)
        self._packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
        scale = self.scale.float()
        zero = self.min.float() + 8 * scale
        self._scale_zero = torch.stack((scale.t(), zero.t()), dim=2).to(torch.bfloat16).contiguous()  # [K/32, N, 2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape  # [..., K]
        if self._w4a8 is not None:
            y = w4a8.matmul(x.reshape(-1, self.in_features).float(), self._w4a8, self.out_features)  # [M, N]
            y = y if self._bias is None else y.add_(self._bias)
            return y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        xb = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self._packed, GROUP, self._scale_zero)  # [M, N]
        if self._bias is not None:
            y = y + self._bias.to(y.dtype)
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)


def select_rows(linear: nn.Module, index: torch.Tensor) -> QuantLinear | None:
    """Output rows `index` of an int8/int4 linear as a linear of their own in the same format (the stored
    integers and scales taken as they are, not quantized again), or None for any other module: a draft
    head's readout is rows of the LM head (model/drafthead.py)."""
    if isinstance(linear, Int8Linear):
        rows = Int8Linear(linear.in_features, len(index), bias=linear.bias is not None, smooth=linear.smooth is not None)
        names = ("qweight", "scale", "bias")
        rows.smooth = linear.smooth
    elif isinstance(linear, Int4Linear):
        rows = Int4Linear(linear.in_features, len(index), bias=linear.bias is not None)
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)
        return y if self.bias is None else y + self.bias


def quant_module(fmt: str, in_features: int, out_features: int, bias: bool, smooth: bool = False) -> QuantLinear:
    if fmt == "int8":
        return Int8Linear(in_features, out_features, bias=bias, smooth=smooth)
    return Int4Linear(in_features, out_features, bias=bias)


def stored_format(weights: dict[str, torch.Tensor], prefix: str) -> str | None:
    """The integer format a linear at `prefix` ('...q_proj.') is stored in, or None for a float weight."""
    if prefix + "min" in weights:
        return "int4"
    if prefix + "qweight" in weights:
        return "int8"
    return None


def install(module: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Swap every nn.Linear of the meta-device `module` whose weights are stored quantized for the module
    that multiplies by them (before the state is loaded). `module` itself may be such a linear only if
    its parent swaps it (shards.py's LM head)."""
    for name, child in list(module.named_modules()):
        if type(child) is not nn.Linear or not name:
            continue
        fmt = stored_format(weights, name + ".")
        if fmt is None:
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        with torch.device("meta"):
            swapped = quant_module(fmt, child.in_features, child.out_features, child.bias is not None,
                                   smooth=name + ".smooth" in weights)
        setattr(parent, attr, swapped)


def has_integer_kernels(device: torch.device | str) -> bool:
    """Whether the int8/int4 products run on `device`: PyTorch's kernels used here are CPU kernels. Elsewhere
    (a GPU cloud) a quantized shard computes with the float weights it stands for, in the compute dtype."""
    return torch.device(device).type == "cpu"


def for_device(weights: dict[str, torch.Tensor], device: torch.device | str) -> dict[str, torch.Tensor]:
    """`weights` as `device` multiplies by them: as stored on a CPU, dequantized elsewhere."""
    return weights if has_integer_kernels(device) else dequantized_state(weights)


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
