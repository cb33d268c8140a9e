"""Weight formats: how a shard stores its linear layers (model/linears.py: the modules that multiply by them).

A decode step streams every weight once, so its floor is the weights' bytes over memory bandwidth. A
shard's decoder layers and LM head are each stored in one of four formats:

    float32   4 bytes a weight
    bfloat16  2 bytes a weight (inside a float32 model its input and output are cast around it)
    int8      1 byte a weight, one float32 scale per output row, and SmoothQuant's factors per input: the
              input is quantized per row to int8 (symmetric, scale = max |x| / 127) and multiplied with
              integer accumulation, so every row gets the same bits whatever else is in the block
    int4      half a byte a weight in groups of 32 along the input, each with a float16 scale and minimum
              (GGUF's Q4_1 layout: w = d * q + m, q in 0..15)

Integer formats keep their state under `qweight`, `scale` (and `smooth` for int8, `min` for int4) in the
shard. Only the CPU has integer kernels here; elsewhere a quantized shard computes with the float weights
it stands for (`for_device`). This module knows nothing of GGUF files (model/gguf_blocks.py reads their
blocks), of kernels (model/linears.py) nor of shards (model/prepare.py chooses a format per part).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError, ModelError

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


def stored_format(weights: dict[str, torch.Tensor], prefix: str) -> str | None:
    """The integer format a linear at `prefix` ('...q_proj.') is stored in, or None for a float weight."""
    if prefix + "min" in weights:
        return "int4"
    if prefix + "qweight" in weights:
        return "int8"
    return None


def has_integer_kernels(device: torch.device | str) -> bool:
    """Whether the int8/int4 products run on `device`: PyTorch's kernels used here are CPU kernels. Elsewhere
    (a GPU cloud) a quantized shard computes with the float weights it stands for, in the compute dtype."""
    return torch.device(device).type == "cpu"


def for_device(weights: dict[str, torch.Tensor], device: torch.device | str) -> dict[str, torch.Tensor]:
    """`weights` as `device` multiplies by them: as stored on a CPU, dequantized elsewhere."""
    return weights if has_integer_kernels(device) else dequantized_state(weights)
