"""The attention and MLP of a decoder layer whose siblings are fused, run without transformers' glue.

Once q/k/v and gate/up are one product each (model/fused.py), transformers' forward still calls the three
(two) sibling slices, views and transposes each, and rotates queries and keys in two passes of seven
tensor calls. At one row those calls cost more than the products. Here a fused layer of a family whose
attention is transformers' plain one (llama, mistral, qwen2: projections, rotary, cache, attention,
output; no q/k norms) takes the fused product's output apart as views, rotates queries and keys together
in one pass, and attends through `exact_rows_sdpa`; the MLP takes the gate and up halves of its fused
output. Every value is computed by the same operations in the same order as transformers' path, so the
bits are the same (tests/model/test_fused.py holds it).

Each replacement holds the original module's children, so the state dict is unchanged, and keeps the
original (`transformers`) for bench step's transformers anchor, which runs transformers' own forward over
the same products. This module knows nothing of shards.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import exact_rows_sdpa

PLAIN_ATTENTION = ("LlamaAttention", "MistralAttention", "Qwen2Attention")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Adopted(nn.Module):
    """A module that stands in for a transformers module: it holds the same children (so the same state dict)
    and reads any other attribute from it; `transformers` is the module itself, which still runs its own
    forward over those children (bench step's transformers anchor)."""

    def __init__(self, original: nn.Module):
        super().__init__()
        object.__setattr__(self, "transformers", original)  # not a submodule: its children are ours
        self._modules.update(original.named_children())
        for name, value in vars(original).items():  # its plain attributes (config, head_dim, ...) read directly
            if not name.startswith("_") and name != "training":
                object.__setattr__(self, name, value)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "transformers"), name)

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        if not isinstance(value, (nn.Module, torch.Tensor)):  # plain attributes (layer_idx) stay in step
            setattr(self.transformers, name, value)


class FusedAttention(Adopted):
    """A plain transformers attention (`PLAIN_ATTENTION`) whose q/k/v are fused (`fused_qkv`) and whose rows
    attend exactly (`exact_rows_sdpa`)."""

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, **kwargs):
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
        out, _ = exact_rows_sdpa(query, key, value, attention_mask, self.scaling, {}, self.native_rows)  # [B, q, H, d]
        return self.o_proj(out.view(batch, rows, -1)), None


class FusedMLP(Adopted):
    """A transformers gated MLP (down(act(gate(x)) * up(x))) whose gate/up are fused (`fused_gate_up`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        both = self.fused_gate_up(x)
        half = both.shape[-1] // 2
        return self.down_proj(self.act_fn(both[..., :half]) * both[..., half:])


def fast_forwards(layer: nn.Module) -> int:
    """Give a loaded decoder layer whose products are fused and whose rows attend exactly the direct forwards:
    its attention and MLP replaced by FusedAttention and FusedMLP; returns how many."""
    done = 0
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if (attn is not None and hasattr(attn, "fused_qkv") and type(attn).__name__ in PLAIN_ATTENTION
            and getattr(attn, "exact_rows", False)):
        layer.self_attn = FusedAttention(attn)
        done += 1
    if mlp is not None and hasattr(mlp, "fused_gate_up") and hasattr(mlp, "act_fn") and hasattr(mlp, "down_proj"):
        if mlp.fused_gate_up.out_features == 2 * mlp.down_proj.in_features:
            layer.mlp = FusedMLP(mlp)
            done += 1
    return done
