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

import numpy as np
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
    """Attention whose rows do not depend on the block around them: each query row attends alone, without a
    mask, to exactly the keys it sees.

    SDPA's float32 result for one query row changes in the last bits with the number of query rows and of
    masked keys beside it, so a tree's row and the same row decoded alone would differ; after the int8 or
    bfloat16 cast of the next product that difference can become a different token. Here row i's keys
    are the cached keys its mask row leaves visible, taken in order: a slice of the cache where they are
    one run (every chain and every row of a one-row step), gathered otherwise. A row decoded alone on a
    cache holding its ancestors sees the same keys in the same order, so both calls have the same shapes
    and values, and a deterministic kernel gives them the same bits; nothing in the call depends on the
    other rows. (Until issue 48 this attended in float64 and rounded back; at 2,048 cached rows the
    conversion doubled a one-row cloud step.) Layers with row-invariant products (int8/int4 weights) attend
    this way; tests/model/test_formats.py checks whole steps bit for bit, trees against chains. The mask is
    splitinfer's (masks.py): 0 where a key is visible, the dtype's minimum where not, or bool.
    """
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise NotImplementedError("exact-rows attention does not take soft-capping or sink tokens")
    batch, heads, rows, dim = query.shape  # [B, H, q, d]
    kv_heads, keys = key.shape[1], key.shape[2]
    if batch == rows == 1:  # a decode step: the loop's one call, without the copy into `out`
        out = _row(query[:, :, 0], key, value, visible_keys(attention_mask, 0, 1, keys)[0], scaling)
        return out.view(1, 1, heads, dim), None
    out = query.new_empty((batch, rows, heads, dim))
    for b in range(batch):
        for i, seen in enumerate(visible_keys(attention_mask, b, rows, keys)):
            out[b, i] = _row(query[b : b + 1, :, i], key[b : b + 1], value[b : b + 1], seen, scaling).reshape(heads, dim)
    return out, None


def _row(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, seen, scaling) -> torch.Tensor:
    """query [1, H, d] of one row; key, value [1, KVH, K, d]; seen: the keys it sees -> [1, KVH, H/KVH, d]."""
    kv_heads = key.shape[1]
    query = query.reshape(1, kv_heads, query.shape[1] // kv_heads, query.shape[2])  # groups as query rows
    if isinstance(seen, slice):
        key, value = key[:, :, seen], value[:, :, seen]
    else:
        key, value = key.index_select(2, seen), value.index_select(2, seen)
    return F.scaled_dot_product_attention(query, key, value, scale=scaling)


class _Memo:
    """The last mask's visible keys: every layer of a step attends with the same mask object."""

    entry: tuple | None = None  # (mask, batch row, keys, result); one tuple, read and written at once


_MEMO = _Memo()


def visible_keys(mask: torch.Tensor | None, b: int, rows: int, keys: int) -> list:
    """Per query row of batch row `b`: the keys it sees, as a slice where they are one run, else indices."""
    if mask is None:
        return [slice(0, keys)] * rows
    entry = _MEMO.entry
    if entry is not None and entry[0] is mask and entry[1:3] == (b, keys):
        return entry[3]
    m = mask[b if mask.shape[0] > 1 else 0, 0, :, :keys]  # [q, K] (or [1, K], broadcast over the rows)
    seen = (m if m.dtype == torch.bool else m == 0).expand(rows, keys).numpy()
    counts = seen.sum(axis=1)
    first = seen.argmax(axis=1)
    last = keys - 1 - seen[:, ::-1].argmax(axis=1)
    result = [slice(int(first[i]), int(last[i]) + 1) if last[i] - first[i] + 1 == counts[i]
              else torch.from_numpy(np.flatnonzero(seen[i])) for i in range(rows)]
    _MEMO.entry = (mask, b, keys, result)
    return result


def install(config: PretrainedConfig) -> None:
    """Make every layer built from `config` attend through `grouped_sdpa`."""
    AttentionInterface.register(NAME, grouped_sdpa)
    config._attn_implementation = NAME
