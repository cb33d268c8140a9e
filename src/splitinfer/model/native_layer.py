"""A whole int4 or int8 decoder layer in one call of kernels/decoder_layer.cpp.

With the products on their own kernels, a one-row step spends much of its time around them: Python and
small tensor calls a layer (the slices of the fused product, rotary, the cache write, residual adds). A layer
whose four products are int4 on kernels/w4a8.py or int8 on kernels/w8a8.py (each input smoothed and quantized
per row in the call, as W8A8Linear does), of a family whose attention is transformers' plain one
(model/fastpath.py's), whose norms are the native RMS norm and whose MLP is SiLU-gated, is built here as a
NativeLayer: one C++ call, the same kernels, the same operations in the same order as model/fastpath.py's
forwards, so the same bits (tests/model/test_native_layer.py compares them), and rows that do not depend on
each other.

A block the call does not take runs the layer's modules (`transformers`, the layer it was built from): a batch
of sessions, another cache class, a compiled pass, autograd. This module knows nothing of shards or steps.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .. import kernels
from ..kv import KVCache
from .attention import visible_keys
from .fastpath import Adopted, FusedAttention, FusedMLP
from .linears import W4A8Linear, W8A8Linear
from .fused import NativeRMSNorm

SILU = ("silu", "swish")
NONE = torch.empty(0)  # an operand a product does not have


class NativeLayer(Adopted):
    """A decoder layer whose attention and MLP are model/fastpath.py's, as one native call (`native_call`)."""

    def __init__(self, layer: nn.Module):
        super().__init__(layer)
        attn, mlp = layer.self_attn, layer.mlp
        products = (attn.fused_qkv, attn.o_proj, mlp.fused_gate_up, mlp.down_proj)
        weights = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        for product in products:
            weights += _operands(product)
        config = attn.config
        self._weights = weights
        self._shape = (config.num_attention_heads, config.num_key_value_heads,
                       float(layer.input_layernorm.variance_epsilon), float(attn.scaling))  # decoder_layer's last arguments
        self._like = torch.empty((1, config.num_key_value_heads, 0, attn.head_dim))

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, position_embeddings=None, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if not (attention_mask is not None and self.runs_native(hidden_states, cache)):
            return self.transformers(hidden_states, attention_mask=attention_mask,
                                     position_embeddings=position_embeddings, **kwargs)
        cos, sin = (t[0].contiguous() for t in position_embeddings)
        return self.native_call(self.self_attn.layer_idx, hidden_states[0].contiguous(), attention_mask, cos, sin,
                                cache)[None]

    def runs_native(self, hidden: torch.Tensor, cache) -> bool:
        """Whether a block [B, q, d] on `cache` takes the native call (else transformers' forward)."""
        return (type(cache) is KVCache and hidden.shape[0] == 1 and hidden.dtype == torch.float32
                and hidden.device.type == "cpu" and not (torch.is_grad_enabled() and hidden.requires_grad)
                and not torch.compiler.is_compiling())

    def native_call(self, layer_idx: int, x: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    cache: KVCache) -> torch.Tensor:
        """x [q, d] contiguous; mask: the block's [1, 1, q, K]; cos, sin [q, head_dim] -> [q, d]."""
        rows = x.shape[0]
        keys, values, start = cache.slots(layer_idx, rows, self._like)
        index, offsets = visible_keys(mask, 1, rows, start + rows)[0]
        return torch.ops.splitinfer.decoder_layer(x, cos, sin, keys[0], values[0], start, index, offsets,
                                                  self._weights, *self._shape)


def run(layers, hidden: torch.Tensor, masks: dict, tables: dict, windows: list, rope_keys: list, cache: KVCache):
    """Layers that are all NativeLayer, on one device, over a block [1, q, d] that `runs_native` took: one
    native call a layer and nothing else between them -> [1, q, d]."""
    x = hidden[0].contiguous()
    rotations = {key: (cos[0].contiguous(), sin[0].contiguous()) for key, (cos, sin) in tables.items()}
    for index, (layer, window, rope_key) in enumerate(zip(layers, windows, rope_keys)):
        x = layer.native_call(index, x, masks[window], *rotations[rope_key], cache)
    return x[None]


STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # rotary types whose tables do not depend on the block
TABLE_ROWS = 256  # positions a call of the rotary module computes while a table grows


class StackCall:
    """Every layer of a stack (all NativeLayer, on the CPU) as one native call a lone block: decoder_layer.cpp's
    NativeStack, which holds the layers' operands (checked once), builds the rows' visible keys from the block's
    structure and the cache length, and runs the layers back to back. After a step has streamed the weights
    through the caches, what Python does around the kernels runs cold: a cloud step of SmolLM2 spent ~0.9 ms
    (15%) on the per-layer calls, masks and rotary tables (measured in notes/benchmarks.md, stop 60).

    The rotary tables are the rotary module's own output for positions 0..P-1, computed in slices and kept:
    elementwise, so a position's row has the bits a call for that position alone gives
    (tests/model/test_native_layer.py holds it)."""

    def __init__(self, layers: list, windows: list, rotary: nn.Module, config):
        first = layers[0]
        heads, kv_heads, eps, scale = first._shape
        self.head_dim = first._like.shape[-1]
        weights = [w for layer in layers for w in layer._weights]
        self.kernel = torch.classes.splitinfer.NativeStack(weights, [w or 0 for w in windows], config.hidden_size,
                                                           heads, kv_heads, self.head_dim, eps, scale)
        self.like, self.rotary, self.layers = first._like, rotary, len(layers)
        self.cos = self.sin = torch.empty(0, self.head_dim)

    @staticmethod
    def fits(rotary: nn.Module) -> bool:
        return getattr(rotary, "rope_type", "default") in STATIC_ROPE and getattr(rotary, "layer_types", None) is None

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor, allowed: np.ndarray, cache: KVCache) -> torch.Tensor:
        """hidden [1, q, d] (`runs_native` took it), positions [q], allowed [q, q], a cache with no held block."""
        self._cover(int(positions.max()) + 1)
        keys, values, start = cache.block_buffers(self.layers, hidden.shape[1], self.like)
        mask = torch.from_numpy(np.ascontiguousarray(allowed, dtype=bool))
        return self.kernel.run(hidden[0].contiguous(), self.cos, self.sin, positions.contiguous(), mask, start, keys,
                               values)[None]

    def _cover(self, positions: int) -> None:
        """Grow the rotary tables to hold `positions` rows (doubling)."""
        if positions <= self.cos.shape[0]:
            return
        size = max(TABLE_ROWS, 1 << (positions - 1).bit_length())
        probe = torch.empty(0)
        parts = [self.rotary(probe, torch.arange(first, first + TABLE_ROWS)[None]) for first in range(0, size, TABLE_ROWS)]
        self.cos = torch.cat([cos[0] for cos, _ in parts]).contiguous()
        self.sin = torch.cat([sin[0] for _, sin in parts]).contiguous()


def _operands(product: nn.Module) -> list[torch.Tensor]:
    """decoder_layer's five operands of a product: packed, bias, then int8's column sums, scales, smoothing."""
    bias = NONE if product._bias is None else product._bias
    if isinstance(product, W4A8Linear):
        return [product._w4a8, bias, NONE, NONE, NONE]
    packed, sums = product._w8a8
    smooth = NONE if product.smooth is None else product.smooth.float().contiguous()
    return [packed, bias, sums, product._scale.reshape(-1).contiguous(), smooth]


def fits(layer: nn.Module) -> bool:
    """Whether `layer` (loaded, fused and given model/fastpath.py's forwards) can run as one native call here."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
    if not (isinstance(attn, FusedAttention) and isinstance(mlp, FusedMLP) and kernels.runs("decoder_layer")):
        return False
    products = (attn.fused_qkv, attn.o_proj, mlp.fused_gate_up, mlp.down_proj)
    return (all(isinstance(p, (W8A8Linear, W4A8Linear)) for p in products)
            and all(isinstance(n, NativeRMSNorm) for n in norms)
            and norms[0].variance_epsilon == norms[1].variance_epsilon
            and getattr(attn.config, "hidden_act", None) in SILU and attn.head_dim % 16 == 0 and attn.head_dim <= 256)
