"""The attention and MLP of a decoder layer whose siblings are fused, run without transformers' glue.

Once q/k/v and gate/up are one product each (model/fused.py), transformers' forward still calls the three
(two) sibling slices, views and transposes each, and rotates queries and keys in two passes of seven
tensor calls. At one row those calls cost more than the products. Here a fused layer of a family whose
attention is transformers' plain one (llama, mistral, qwen2: projections, rotary, cache, attention,
output; no q/k norms) takes the fused product's output apart as views, rotates queries and keys together
in one pass, and attends through `exact_rows_sdpa`; the MLP takes the gate and up halves of its fused
output. Every value is computed by the same operations in the same order as transformers' path, so the
bits are the same (tests/model/test_fused.py holds it).

A layer whose attention is not splitinfer's (bench step's transformers anchor copies the layers and points
them back at transformers' sdpa) keeps transformers' forward. This module knows nothing of shards.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from .attention import NAME, exact_rows_sdpa

PLAIN_ATTENTION = ("LlamaAttention", "MistralAttention", "Qwen2Attention")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class FusedAttention(nn.Module):
    """Mixed in before a plain transformers attention class whose q/k/v are fused (`fused_qkv`)."""

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, **kwargs):
        if self.config._attn_implementation != NAME or not getattr(self, "exact_rows", False):
            return super().forward(hidden_states, position_embeddings=position_embeddings,
                                   attention_mask=attention_mask, **kwargs)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        batch, rows = hidden_states.shape[:2]
        heads, kv_heads = self.config.num_attention_heads, self.config.num_key_value_heads
        qkv = self.fused_qkv(hidden_states).view(batch, rows, -1, self.head_dim)  # [B, q, H + 2 KVH, d]
        cos, sin = (t[:, :, None] for t in position_embeddings)  # [B, q, 1, d]
        qk = qkv[:, :, : heads + kv_heads]
        qk = (qk * cos) + (_rotate_half(qk) * sin)
        query, key = qk[:, :, :heads].transpose(1, 2), qk[:, :, heads:].transpose(1, 2)  # [B, *, q, d]
        value = qkv[:, :, heads + kv_heads :].transpose(1, 2)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        out, _ = exact_rows_sdpa(query, key, value, attention_mask, self.scaling, {})  # [B, q, H, d]
        return self.o_proj(out.view(batch, rows, -1)), None


class FusedMLP(nn.Module):
    """Mixed in before a transformers gated MLP (down(act(gate(x)) * up(x))) whose gate/up are fused."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        both = self.fused_gate_up(x)
        half = both.shape[-1] // 2
        return self.down_proj(self.act_fn(both[..., :half]) * both[..., half:])


@functools.cache
def _mixed(mixin: type, cls: type) -> type:
    return type("Fused" + cls.__name__, (mixin, cls), {})


def install(layer: nn.Module) -> int:
    """Give a loaded decoder layer's fused attention and MLP their direct forwards; returns how many."""
    done = 0
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is not None and hasattr(attn, "fused_qkv") and type(attn).__name__ in PLAIN_ATTENTION:
        attn.__class__ = _mixed(FusedAttention, type(attn))
        done += 1
    if mlp is not None and hasattr(mlp, "fused_gate_up") and hasattr(mlp, "act_fn") and hasattr(mlp, "down_proj"):
        if mlp.fused_gate_up.out_features == 2 * mlp.down_proj.in_features:
            mlp.__class__ = _mixed(FusedMLP, type(mlp))
            done += 1
    return done
