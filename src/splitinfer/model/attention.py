"""The attention function splitinfer's layers call: torch SDPA with grouped keys and values read in place.

splitinfer passes an explicit mask on every block (a relative causal mask attends to the wrong keys once a
cache holds rows; docs/design.md, "Blocks, masks and the KV cache"). With a mask and more than one query row, transformers' sdpa path expands
grouped-query keys and values to every query head (`repeat_kv`) on every layer before calling SDPA: at
2,048 cached rows on SmolLM2 (3 key/value heads for 9 query heads) that copy is most of what a block of
two rows costs beyond a block of one. Here the query heads that share a key/value head are stacked as
extra query rows instead, [B, H, q, d] -> [B, KVH, H/KVH * q, d], with the block's mask repeated to match,
so SDPA reads each cached key once. The same dot products, the same softmax per row; the output is
reshaped back. One row, no grouping, or anything unusual (dropout in training, soft-capping) takes
transformers' own sdpa function.

`install(config)` registers the function with transformers' AttentionInterface under `NAME` and points the
config (shared by every layer built from it) at it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PretrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "splitinfer_sdpa"


def grouped_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, q, d]
    key: torch.Tensor,  # [B, KVH, K, d]
    value: torch.Tensor,  # [B, KVH, K, d]
    attention_mask: torch.Tensor | None,  # [B, 1, q, K] additive or bool
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if getattr(module, "exact_rows", False):
        return exact_rows_sdpa(query, key, value, attention_mask, scaling, kwargs)
    batch, heads, rows, dim = query.shape
    groups = heads // key.shape[1]
    plain = (groups == 1 or rows == 1 or attention_mask is None or attention_mask.shape[1] != 1
             or dropout > 0.0 or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None)
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    stacked = query.reshape(batch, heads // groups, groups * rows, dim)  # head h = kv * groups + g
    mask = attention_mask[:, :, :, : key.shape[2]].repeat(1, 1, groups, 1)  # row (g, i) sees row i's keys
    out = F.scaled_dot_product_attention(stacked, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, rows, dim).transpose(1, 2).contiguous(), None  # [B, q, H, d]


def exact_rows_sdpa(query, key, value, attention_mask, scaling, kwargs) -> tuple[torch.Tensor, None]:
    """Attention whose rows do not depend on the block around them: computed in float64 and rounded back.

    SDPA's float32 result for one query row changes in the last bits with the number of query rows and of
    (masked) keys beside it, so a tree's row and the same row decoded alone differ; after a bfloat16 or
    int8 cast of the next product that difference can become a different token. In float64 the two
    orders differ by ~1e-16 relative, far below float32's rounding step (6e-8), so both round to the same
    float32 unless a value lies within ~1e-16 of a rounding boundary. Layers with row-invariant products
    (int8/int4 weights) attend this way; tests/model/test_formats.py checks whole steps bit for bit.
    """
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise NotImplementedError("exact-rows attention does not take soft-capping or sink tokens")
    batch, heads, rows, dim = query.shape  # [B, H, q, d]
    groups = heads // key.shape[1]
    wide = torch.float64
    stacked = query.to(wide).reshape(batch, heads // groups, groups * rows, dim)
    mask = attention_mask
    if mask is not None:
        mask = mask[:, :, :, : key.shape[2]].to(wide).repeat(1, 1, groups, 1)
    out = F.scaled_dot_product_attention(stacked, key.to(wide), value.to(wide), attn_mask=mask, scale=scaling)
    return out.to(query.dtype).reshape(batch, heads, rows, dim).transpose(1, 2).contiguous(), None


def install(config: PretrainedConfig) -> None:
    """Make every layer built from `config` attend through `grouped_sdpa`."""
    AttentionInterface.register(NAME, grouped_sdpa)
    config._attn_implementation = NAME
