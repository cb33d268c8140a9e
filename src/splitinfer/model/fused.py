"""Fewer calls a decoder layer: sibling products fused (q/k/v as one integer product, gate/up as
another), and RMS norms as one call.

A decoder layer multiplies the same input by q_proj, k_proj and v_proj, and the MLP's input by gate_proj
and up_proj. In an integer format (model/formats.py) each of those products quantizes its input on its
own and calls its kernel on its own; at one or a few rows, where a product streams a small weight, that
per-call work is a large share of the step. Here the siblings' stored rows are concatenated at load into
one module (`fused_qkv` on the attention module, `fused_gate_up` on the MLP): one input quantization and
one kernel call, whose output columns are the siblings' outputs side by side.

The transformers layer still calls `q_proj(x)`, `k_proj(x)`, `v_proj(x)` in turn; each is now a
`Slice` that hands back its columns of the fused output. The first slice computes the fused product and
keeps it for the others while they are called with the same input tensor (by identity); a slice called on
another input computes the fused product for itself, so the result never depends on the call order.
(Families whose attention is transformers' plain one skip the slices: model/fastpath.py.)

When siblings fuse: int4 always (a group of 32 weights stands alone, so rows concatenate). int8 when the
siblings were smoothed with one vector: `prepare` calibrates a fusion group's SmoothQuant factors
against the maximum over all its weights' columns (`group_column_maxima`), so one quantized input serves
every sibling. Shards made before that keep their own vectors and stay unfused. The integer products
are the same per row either way, so rows stay invariant (tests/model/test_formats.py).

A llama-family RMS norm is eight tensor calls in transformers' Python; `fuse_norms` swaps each for
`torch.nn.functional.rms_norm`, one call doing the same operations in the same order, where a probe at
load gives the same bits (else it leaves the norm as it is). On CPU that call is itself a composite of seven
(~30 us at one row); in a layer with integer products, whose bits are its format's and never compared with
transformers', the norm is kernels/rms_norm.cpp's one pass a row instead where it runs.

The stored state is untouched: shards, manifests and `load_whole_hf` (the float reference) see q/k/v as
they were stored. This module knows nothing of shards or steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from . import linears
from .linears import Int4Linear, Int8Linear, QuantLinear
from .rows import replace_children

# {submodule of a decoder layer: (fused attribute, sibling linears in the order the layer calls them)}
GROUPS = {"self_attn": ("fused_qkv", ("q_proj", "k_proj", "v_proj")), "mlp": ("fused_gate_up", ("gate_proj", "up_proj"))}


def group_keys(key: str) -> list[str] | None:
    """The state keys of the fusion group '<layer>.self_attn.k_proj.weight' belongs to, or None."""
    owner, _, leaf = key.rpartition(".")
    parent, _, name = owner.rpartition(".")
    siblings = GROUPS.get(parent.rpartition(".")[2], (None, ()))[1]
    if name not in siblings:
        return None
    return [f"{parent}.{sibling}.{leaf}" for sibling in siblings]


def group_column_maxima(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{weight key: max |W[:, k]| over every weight of its fusion group} [K], for the group's one shared
    SmoothQuant vector (formats.quantize_int8's `column_max`)."""
    out = {}
    for key in state:
        keys = group_keys(key)
        if keys is None or key in out or not all(k in state for k in keys):
            continue
        column_max = torch.stack([state[k].detach().float().abs().amax(dim=0) for k in keys]).amax(dim=0)
        out.update({k: column_max for k in keys})
    return out


class Slice(nn.Module):
    """Columns [start, end) of a fused product, in the place of the sibling linear they stand for."""

    def __init__(self, group: "_Shared", start: int, end: int, in_features: int, last: bool):
        super().__init__()
        object.__setattr__(self, "group", group)  # not a submodule: its state belongs to the parent
        self.start, self.end, self.last = start, end, last
        self.in_features, self.out_features = in_features, end - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.output(x, self.last)[..., self.start : self.end]

    @property
    def weight(self) -> torch.Tensor:
        """The float32 weight this slice stands for (readers outside the step, as QuantLinear's)."""
        return self.group.fused.weight[self.start : self.end]


class _Shared:
    """The fused module and its last input/output pair (held until the group's last sibling has read it)."""

    def __init__(self, fused: QuantLinear):
        self.fused = fused
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None

    def output(self, x: torch.Tensor, last: bool) -> torch.Tensor:
        out = self._output if x is self._input else self.fused(x)
        self._input, self._output = (None, None) if last else (x, out)
        return out


def _concatenated(modules: list[QuantLinear]) -> QuantLinear | None:
    """One module holding `modules`' rows in order, or None where they cannot share an input."""
    first = modules[0]
    kinds = {type(m) for m in modules}
    if len(kinds) != 1 or not issubclass(kinds.pop(), (Int8Linear, Int4Linear)):
        return None
    if len({m.in_features for m in modules}) != 1 or len({m.bias is None for m in modules}) != 1:
        return None
    names = ["qweight", "scale", "min", "bias"]
    if isinstance(first, Int8Linear):
        if len({m.smooth is None for m in modules}) != 1:
            return None
        if first.smooth is not None and not all(torch.equal(m.smooth, first.smooth) for m in modules):
            return None  # smoothed one by one (a shard from before group calibration)
        names = ["qweight", "scale", "bias"]
    out_features = sum(m.out_features for m in modules)
    kernel = linears.kernel_class("int8" if isinstance(first, Int8Linear) else "int4", first.in_features, out_features)
    if isinstance(first, Int8Linear):
        fused = kernel(first.in_features, out_features, bias=first.bias is not None, smooth=first.smooth is not None)
        if first.smooth is not None:
            fused.smooth = first.smooth
    else:
        fused = kernel(first.in_features, out_features, bias=first.bias is not None)
    states = [m.stored_state() for m in modules]  # an int8 weight already packed: unpacked from its tiles
    for name in names:
        if name in states[0]:
            setattr(fused, name, torch.cat([state[name] for state in states]))
    fused.finish()
    return fused


def fuse_layer(layer: nn.Module) -> int:
    """Fuse the sibling products of one loaded decoder layer in place; returns the groups fused."""
    fused_groups = 0
    for owner_name, (attr, siblings) in GROUPS.items():
        owner = getattr(layer, owner_name, None)
        modules = [getattr(owner, name, None) for name in siblings]
        if owner is None or not all(isinstance(m, QuantLinear) for m in modules):
            continue
        fused = _concatenated(modules)
        if fused is None:
            continue
        setattr(owner, attr, fused)
        shared, start = _Shared(fused), 0
        for name, module in zip(siblings, modules):
            end = start + module.out_features
            setattr(owner, name, Slice(shared, start, end, module.in_features, last=name == siblings[-1]))
            start += module.out_features
        fused_groups += 1
    return fused_groups


class _OneCallNorm(nn.Module):
    """An RMS norm holding a transformers norm's own weight (so its state dict) and epsilon."""

    def __init__(self, weight: nn.Parameter, eps: float):
        super().__init__()
        self.weight, self.variance_epsilon = weight, eps
        self._shape = (weight.shape[-1],)


class RMSNormCall(_OneCallNorm):
    """A transformers RMS norm as one `F.rms_norm` call: y = x * rsqrt(mean(x^2) + eps) * weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self._shape, self.weight, self.variance_epsilon)


class NativeRMSNorm(_OneCallNorm):
    """The same norm through kernels/rms_norm.cpp, one pass a row (its own rounding: integer layers only)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:  # the kernel has no gradient (training a draft head)
            return F.rms_norm(x, self._shape, self.weight, self.variance_epsilon)
        return torch.ops.splitinfer.rms_norm(x, self.weight, self.variance_epsilon)


def norm_module(norm: nn.Module, own_bits: bool = False) -> nn.Module | None:
    """The one-call module for a transformers RMS norm (float32, on its device), or None to keep `norm`:
    `NativeRMSNorm` where `own_bits` (a layer whose products are integer, so its bits are its format's, not
    transformers') and the kernel runs here, else `RMSNormCall` where a probe gives transformers' bits."""
    weight, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
    if (not type(norm).__name__.endswith("RMSNorm") or not isinstance(weight, torch.Tensor)
            or weight.dtype != torch.float32 or eps is None):
        return None
    if own_bits and weight.shape[-1] % 16 == 0 and weight.device.type == "cpu" and kernels.runs("rms_norm"):
        return NativeRMSNorm(weight, eps)
    return RMSNormCall(weight, eps) if _same_bits(norm, weight, eps) else None


def fuse_norms(layer: nn.Module, own_bits: bool = False) -> int:
    """Replace the RMS norms inside a loaded decoder layer by their one-call modules (`norm_module`); returns
    how many."""
    return replace_children(layer, lambda child: norm_module(child, own_bits))


def _same_bits(norm: nn.Module, weight: torch.Tensor, eps: float) -> bool:
    """Whether `F.rms_norm` gives `norm`'s bits on a probe of three rows at very different scales."""
    probe = torch.randn(3, weight.shape[-1], generator=torch.Generator().manual_seed(0), dtype=weight.dtype)
    probe = probe.to(weight.device) * torch.tensor([[1e-3], [1.0], [1e3]], device=weight.device)
    with torch.no_grad():
        return torch.equal(norm(probe), F.rms_norm(probe, (weight.shape[-1],), weight, eps))
