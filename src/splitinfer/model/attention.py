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

from typing import NamedTuple

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
        return exact_rows_sdpa(query, key, value, attention_mask, scaling, kwargs, getattr(module, "native_rows", False))
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


def exact_rows_sdpa(query, key, value, attention_mask, scaling, kwargs, native: bool = False) -> tuple[torch.Tensor, None]:
    """Attention whose rows do not depend on the block around them: each query row attends alone, without a
    mask, to exactly the keys it sees.

    SDPA's float32 result for one query row changes in the last bits with the number of query rows and of
    masked keys beside it, so a tree's row and the same row decoded alone would differ; after the int8 or
    bfloat16 cast of the next product that difference can become a different token. Here row i attends to
    the keys its mask row leaves visible, in order: one run of them, then (a tree row off the block's first
    chain) a few ancestors scattered after it. A row decoded alone on a cache holding its ancestors sees
    the same keys in the same order, so both calls have the same shapes and values, and a deterministic
    kernel gives them the same bits; nothing in the call depends on the other rows. (Attending in float64 and
    rounding back would do it too, but at 2,048 cached rows the conversion doubled a one-row cloud step.)

    The scattered keys are not gathered with the run before them (a copy of the whole cached prefix per
    row and layer: 6 of the 73 ms of an int8 tree step in one profile): they are written into the slots
    right after the run, which is then a slice of `key`/`value`. Those are views of the KV cache's buffers,
    so the keys written over (the block's own rows) are saved first and put back on every exit path, and
    rows attend in an order where no row's run holds another row's writes (`row_plans`). Keys that cannot
    be written in place (autograd, an inference tensor outside inference mode, expanded) are cloned first.

    `native` (the layer was built with kernels/rows_attention.cpp: model/layers.py) and float32 on a CPU:
    `native_rows_sdpa` does the same in one call a batch row, each row reading its keys in place: no writes,
    no copies, other rounding.

    Layers with row-invariant products (int8/int4 weights) attend this way; tests/model/test_formats.py
    checks whole steps bit for bit, trees against chains, and tests/model/test_attention.py this function
    against the gathering one. The mask is splitinfer's (masks.py): 0 where a key is visible, the dtype's
    minimum where not, or bool.
    """
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise NotImplementedError("exact-rows attention does not take soft-capping or sink tokens")
    if native and _native_fits(query, key, value):
        return native_rows_sdpa(query, key, value, attention_mask, scaling), None
    batch, heads, rows, dim = query.shape  # [B, H, q, d]; key, value [B, KVH, K, d]
    plans = row_plans(attention_mask, batch, rows, key.shape[2])
    if batch == rows == 1 and plans[0].index is None:  # a decode step: one slice, without the copy into `out`
        _, first, end, _, _ = plans[0].order[0]
        return _row(query[:, :, 0], key, value, first, end, scaling).view(1, 1, heads, dim), None
    if any(plan.index is not None for plan in plans) and not (_writable(key) and _writable(value)):
        key, value = key.clone(), value.clone()
    out = query.new_empty((batch, rows, heads, dim))
    for b, plan in enumerate(plans):
        _attend(query[b : b + 1], key[b : b + 1], value[b : b + 1], plan, scaling, out[b])
    return out, None


def _native_fits(query, key, value) -> bool:
    """Whether rows_attention.cpp takes this call: float32 on the CPU, head sizes it holds, no gradient."""
    dim = query.shape[-1]
    grads = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    return (not grads and query.dtype == key.dtype == value.dtype == torch.float32 and query.device.type == "cpu"
            and dim % 16 == 0 and dim <= 256 and key.stride(-1) == 1 and value.stride(-1) == 1)


def native_rows_sdpa(query, key, value, attention_mask, scaling) -> torch.Tensor:
    """Exact-rows attention in one call a batch row (rows_attention.cpp): each row reads its visible keys in
    place, in ascending order, so nothing is copied or written. -> [B, q, H, d]."""
    batch, heads, rows, dim = query.shape
    scale = dim**-0.5 if scaling is None else float(scaling)
    seen = visible_keys(attention_mask, batch, rows, key.shape[2])
    if batch == 1:
        return torch.ops.splitinfer.rows_attention(query[0], key[0], value[0], *seen[0], scale).unsqueeze(0)
    out = query.new_empty((batch, rows, heads, dim))
    for b, (index, offsets) in enumerate(seen):
        out[b] = torch.ops.splitinfer.rows_attention(query[b], key[b], value[b], index, offsets, scale)
    return out


def visible_keys(mask: torch.Tensor | None, batch: int, rows: int, keys: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per batch row, the keys each query row sees as (index, offsets): row i's are index[offsets[i]:offsets[i+1]],
    ascending. Every layer of a step attends with the same mask object: the last one's lists are kept."""
    if mask is None:
        return [(torch.arange(keys).repeat(rows), torch.arange(rows + 1) * keys)] * batch
    entry = _VISIBLE.entry
    if entry is not None and entry[0] is mask and entry[1:4] == (batch, rows, keys):
        return entry[4]
    lists = []
    for b in range(batch):
        m = mask[b if mask.shape[0] > 1 else 0, 0, :, :keys]
        seen = (m if m.dtype == torch.bool else m == 0).expand(rows, keys).numpy()
        offsets = np.concatenate([[0], np.cumsum(seen.sum(axis=1))])
        lists.append((torch.from_numpy(np.nonzero(seen)[1].astype(np.int64)), torch.from_numpy(offsets.astype(np.int64))))
    _VISIBLE.entry = (mask, batch, rows, keys, lists)
    return lists


def _attend(query, key, value, plan: RowPlan, scaling, out: torch.Tensor) -> None:
    """query [1, H, q, d], key and value [1, KVH, K, d] of one batch row -> out [q, H, d]; `key` and
    `value` hold what they held before, also when a row raises."""
    heads, dim = out.shape[1:]
    if plan.index is None:
        for i, first, end, _, _ in plan.order:
            out[i] = _row(query[:, :, i], key, value, first, end, scaling).reshape(heads, dim)
        return
    pool = key.index_select(2, plan.index), value.index_select(2, plan.index)  # read before any write
    try:
        for i, first, end, extra, at in plan.order:
            if extra:
                key.narrow(2, end, extra).copy_(pool[0].narrow(2, at, extra))
                value.narrow(2, end, extra).copy_(pool[1].narrow(2, at, extra))
            out[i] = _row(query[:, :, i], key, value, first, end + extra, scaling).reshape(heads, dim)
    finally:
        low, high = plan.written
        saved = plan.index.shape[0] - (high - low)  # the saved keys [low, high) close the pool
        key.narrow(2, low, high - low).copy_(pool[0].narrow(2, saved, high - low))
        value.narrow(2, low, high - low).copy_(pool[1].narrow(2, saved, high - low))


def _row(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, first: int, end: int, scaling) -> torch.Tensor:
    """query [1, H, d] of one row; key, value [1, KVH, K, d]; it sees keys [first, end) -> [1, KVH, H/KVH, d]."""
    kv_heads = key.shape[1]
    query = query.reshape(1, kv_heads, query.shape[1] // kv_heads, query.shape[2])  # groups as query rows
    key, value = key.narrow(2, first, end - first), value.narrow(2, first, end - first)
    return F.scaled_dot_product_attention(query, key, value, scale=scaling)


def _writable(t: torch.Tensor) -> bool:
    """Whether writing into `t` and back is allowed and leaves nothing else changed: no autograd history to
    break, not an inference tensor outside inference mode, no two keys in one place (an expanded tensor)."""
    if t.requires_grad and torch.is_grad_enabled():
        return False
    if t.is_inference() and not torch.is_inference_mode_enabled():
        return False
    return all(stride or size == 1 for stride, size in zip(t.stride()[1:], t.shape[1:]))


class RowPlan(NamedTuple):
    """How the query rows of one batch row attend (see `row_plans`)."""

    # (row, first, end, extra, at), `end` descending: the row sees keys [first, end), then `extra` scattered
    # keys, found at `at` in the pool and written into slots [end, end + extra) before it attends
    order: list[tuple[int, int, int, int, int]]
    index: torch.Tensor | None  # the pool's keys: each row's scattered keys, then [low, high); None: no writes
    written: tuple[int, int]  # (low, high): the slots some row writes into


class _Memo:
    """The last mask's plans: every layer of a step attends with the same mask object."""

    entry: tuple | None = None  # (mask, batch, rows, keys, plans); one tuple, read and written at once


_MEMO = _Memo()
_VISIBLE = _Memo()


def row_plans(mask: torch.Tensor | None, batch: int, rows: int, keys: int) -> list[RowPlan]:
    """Per batch row: each query row's visible keys, as a run and the keys scattered after it.

    Rows attend in descending order of their run's end: the slots a row writes start at its run's end, so
    every write comes after the runs of the rows still to attend, and no run ever holds a written slot.
    A row's slots fit in `keys`: its `extra` scattered keys are distinct and all after slot `end`.
    """
    if mask is None:
        return [RowPlan([(i, 0, keys, 0, 0) for i in range(rows)], None, (0, 0))] * batch
    entry = _MEMO.entry
    if entry is not None and entry[0] is mask and entry[1:4] == (batch, rows, keys):
        return entry[4]
    plans = []
    for b in range(batch):
        m = mask[b if mask.shape[0] > 1 else 0, 0, :, :keys]  # [q, K] (or [1, K], broadcast over the rows)
        plans.append(_plan((m if m.dtype == torch.bool else m == 0).expand(rows, keys).numpy()))
    _MEMO.entry = (mask, batch, rows, keys, plans)
    return plans


def _plan(seen: np.ndarray) -> RowPlan:
    """seen [q, K] bool -> the plan of one batch row."""
    order, scattered, at = [], [], 0
    for i, row in enumerate(seen):
        index = np.flatnonzero(row)
        breaks = np.flatnonzero(np.diff(index) != 1)
        run = int(breaks[0]) + 1 if len(breaks) else len(index)
        first = int(index[0]) if len(index) else 0
        order.append((i, first, first + run, len(index) - run, at))
        if run < len(index):
            scattered.append(index[run:])
            at += len(index) - run
    order.sort(key=lambda row: -row[2])
    if not scattered:
        return RowPlan(order, None, (0, 0))
    low = min(end for _, _, end, extra, _ in order if extra)
    high = max(end + extra for _, _, end, extra, _ in order)
    return RowPlan(order, torch.from_numpy(np.concatenate([*scattered, np.arange(low, high)])), (low, high))


def install(config: PretrainedConfig) -> None:
    """Make every layer built from `config` attend through `grouped_sdpa`."""
    AttentionInterface.register(NAME, grouped_sdpa)
    config._attn_implementation = NAME
