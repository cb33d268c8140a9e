"""Build a decoder layer in its final form, and report what runs: the one place a module's kernel is chosen.

Loading a shard builds each layer from its stored weights once; nothing is swapped afterwards, and each
module runs one forward. What runs for each piece, chosen from the stored format and what this machine
offers (kernels/build.py's `runs`: the library loaded, the kernel not turned off):

    piece             chosen                                             else
    float linear      RowsLinear (oneDNN packed from 4 rows)             CastLinear (bfloat16 weight, float32 model)
    int8 linear       W8A8Linear (kernels/w8a8)                          FbgemmLinear, or IntMMLinear without FBGEMM
    int4 linear       W4A8Linear (kernels/w4a8)                          TorchInt4Linear (PyTorch's, bfloat16 inputs)
    sibling products  fused: q/k/v and gate/up one product each          separate (float formats)
                      (integer formats; model/fused.py)
    RMS norm          NativeRMSNorm (integer layers, kernels/rms_norm)   RMSNormCall (F.rms_norm, where it gives
                                                                         transformers' bits), else the family's
    attention, MLP    FusedAttention, FusedMLP (fused layers of plain    the family's (transformers' forward)
                      families; model/fastpath.py)
    attention rows    exact rows (integer layers), rows_attention        exact rows in PyTorch; float layers:
                      kernel where it runs (model/attention.py)          grouped SDPA
    the layer         NativeLayer: one call (model/native_layer.py)      the modules above, in Python

`kernel_table` counts what was chosen over any loaded modules: `serve` logs it, `bench step` stores it.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn
from transformers import PretrainedConfig

from .. import kernels
from . import arena
from .fastpath import fast_forwards
from .linears import QuantLinear
from .fused import fuse_layer, fuse_norms
from .native_layer import NativeLayer, fits
from .stack import LayerStack, materialize


def build_layer(meta_layer: nn.Module, weights: dict, device: str, dtype) -> nn.Module:
    """One decoder layer (a meta-device transformers layer) loaded from `weights` and built in its final form."""
    layer = materialize(meta_layer, weights, device, dtype)  # each linear the module of its stored format
    integer = any(isinstance(m, QuantLinear) for m in layer.modules())
    if integer:
        fuse_layer(layer)  # q/k/v and gate/up as one product each
    fuse_norms(layer, own_bits=integer)  # one call each: transformers' bits, or (integer) the native kernel
    attn = getattr(layer, "self_attn", None)
    if attn is not None:
        # Row-invariant products (int8/int4) need row-invariant attention to keep speculation exact.
        attn.exact_rows = integer
        attn.native_rows = integer and kernels.runs("rows_attention")
    fast_forwards(layer)  # fused plain-family layers: attention and MLP without transformers' glue
    return NativeLayer(layer) if fits(layer) else layer


def kernel_table(*modules: nn.Module) -> dict[str, int]:
    """{module class (and, for attention, its rows' kernel): how many} over `modules`, each counted once:
    what runs, as loading chose it."""
    seen, counts = set(), Counter()
    for root in modules:
        for module in root.modules():
            if id(module) in seen or not _reported(module):
                continue
            seen.add(id(module))
            name = type(module).__name__
            if getattr(module, "exact_rows", False):
                name += " (rows: " + ("rows_attention kernel" if module.native_rows else "pytorch") + ")"
            counts[name] += 1
    return dict(sorted(counts.items()))


def _reported(module: nn.Module) -> bool:
    name = type(module).__name__
    return (isinstance(module, (nn.Linear, QuantLinear, NativeLayer)) or name.endswith(("RMSNorm", "RMSNormCall"))
            or name.endswith("Attention") or name.endswith("MLP"))


def build_stack(
    config: PretrainedConfig,
    model: nn.Module,
    start: int,
    end: int,
    weights: dict[str, torch.Tensor],
    device: str,
    dtype: torch.dtype,
) -> LayerStack:
    """Layers [start, end) of the meta `model`, each built in its final form from `weights` keyed
    `model.layers.{i}.*` (model/layers.py)."""
    layers = []
    for i in range(start, end):
        prefix = f"model.layers.{i}."
        layer_weights = {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
        layers.append(build_layer(model.model.layers[i], layer_weights, device, dtype))
    arena.gather([w for layer in layers for w in arena.packed_weights(layer)])  # before a native stack points into them
    rotary = type(model.model.rotary_emb)(config=config).to(device)
    return LayerStack(config, layers, start, rotary).eval()
