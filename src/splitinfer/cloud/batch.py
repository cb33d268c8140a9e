"""One forward pass of the middle layers over the pending blocks of several sessions at once.

Each session brings its own block (rows, positions, in-block structure) and its own KVCache with its own
committed length. The blocks are padded into one [B, Q, d] batch and run through the model family's own
HF decoder layers, so every matmul sees B*Q rows instead of q; what keeps sessions apart is the cache
adapter and the mask:

- `_BatchCache.update` writes each session's real rows (not the padding) into that session's KVCache,
  exactly where a lone step would have put them, and hands the attention a zero-padded [B, kv_heads, K, hd]
  view where session b's keys occupy columns 0..L_b+q_b-1 (committed rows, then its block).
- The additive mask [B, 1, Q, K] is, for session b, the very mask a lone step builds (committed rows,
  sliding window, in-block structure) in its top-left corner; padding keys are masked for real rows.
  Padding query rows see key 0 only, so no softmax row is empty; their outputs are discarded.

A block in flight (protocol v3) is written after the pending blocks it builds on (`Block.prefix`): its
key columns are the committed rows, those pending rows, then its own, and its mask sees the pending rows
it assumes kept (wire/inflight.py); a batched pass places that mask in the session's corner the same way.

All blocks of one call run the same layers (`stack`): sessions with different head depths (split-point
randomisation) go through separate calls, grouped by the caller (sessions.py, scheduler.py).
This module knows nothing about sessions, validation or scheduling: it takes blocks and returns rows.
The session table reaches it through a pass executor, `LocalPasses` here (one process) or
tensorparallel.py's `Rank0Passes` (every rank of a tensor-parallel group runs the same pass).
The cost is one copy of each session's keys into a padded workspace per layer (the memory traffic
attention itself spends reading them); the workspace is allocated once per pass, not per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..kv import KVCache
from ..masks import attention_mask
from ..model.stack import LayerStack
from ..wire.inflight import Prefix, prefix_mask

if TYPE_CHECKING:
    from ..model.shards import CloudHalf


@dataclass
class Block:
    """One session's pending step, already validated and on the stack's input device and dtype."""

    hidden: torch.Tensor  # [q, d]
    positions: torch.Tensor  # [q] long, absolute positions
    allowed: np.ndarray  # [q, q] bool, in-block visibility
    cache: KVCache  # the session's cache; the block is left pending in it
    prefix: Prefix | None = None  # the pending rows (held in the cache) this block is written after

    def mask(self, dtype: torch.dtype, window: int | None) -> torch.Tensor:
        """The block's lone-step additive mask [1, 1, q, L + h + q]."""
        if self.prefix is None:
            return attention_mask(self.cache.length, self.positions, self.allowed, dtype, window=window)
        return prefix_mask(self.cache.length, self.prefix, self.positions, self.allowed, dtype, window=window)

    @property
    def key_len(self) -> int:
        """Key columns the block attends over: committed rows, held pending rows, its own rows."""
        return self.cache.length + self.cache.held_rows + self.positions.shape[0]


class _BatchCache:
    """Duck-types the HF cache `update` for a padded batch of sessions with separate KVCaches."""

    def __init__(self, caches: Sequence[KVCache], rows: Sequence[int], key_len: int):
        self.caches, self.rows, self.key_len = caches, rows, key_len
        # One padded workspace per device, reused by every layer on it: each layer overwrites the same valid
        # region (session b's L_b + q_b rows) and the padding stays zero (finite: NaN would leak through a mask).
        self._workspace: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        # key, value: [B, kv_heads, Q, head_dim] -> padded [B, kv_heads, K, head_dim]
        batch, heads, _, head_dim = key.shape
        if key.device not in self._workspace:
            shape = (batch, heads, self.key_len, head_dim)
            self._workspace[key.device] = (key.new_zeros(shape), value.new_zeros(shape))
        keys, values = self._workspace[key.device]
        for b, (cache, q) in enumerate(zip(self.caches, self.rows)):
            k, v = cache.update(key[b : b + 1, :, :q], value[b : b + 1, :, :q], layer_idx)
            keys[b, :, : k.shape[2]] = k[0]
            values[b, :, : v.shape[2]] = v[0]
        return keys, values


def batch_mask(
    blocks: Sequence[Block], query_len: int, key_len: int, dtype: torch.dtype, window: int | None
) -> torch.Tensor:
    """Additive mask [B, 1, Q, K]: each session's lone-step mask in its corner, everything else masked."""
    device = blocks[0].positions.device
    mask = torch.full((len(blocks), 1, query_len, key_len), torch.finfo(dtype).min, dtype=dtype, device=device)
    for b, block in enumerate(blocks):
        q = block.positions.shape[0]
        lone = block.mask(dtype, window)
        mask[b, 0, :q, : lone.shape[-1]] = lone[0, 0]
        mask[b, 0, q:, 0] = 0.0  # padding rows: one visible key keeps softmax defined
    return mask


def forward_blocks(stack: LayerStack, blocks: Sequence[Block]) -> list[torch.Tensor]:
    """Run every block through `stack` in one pass; returns each block's output rows [q_b, d] in order.

    A single block takes the lone path (`stack.forward`), so a session alone computes exactly as before.
    """
    with stack.grad_mode():
        return _forward_blocks(stack, blocks)


def _forward_blocks(stack: LayerStack, blocks: Sequence[Block]) -> list[torch.Tensor]:
    if not blocks:
        return []
    if len(blocks) == 1 and blocks[0].prefix is None:
        block = blocks[0]
        return [stack(block.hidden[None], block.positions, block.allowed, block.cache)[0]]
    if len(blocks) == 1:
        block = blocks[0]
        masks = {w: block.mask(block.hidden.dtype, w) for w in set(stack.windows)}
        return [stack.run_layers(block.hidden[None], block.positions[None], masks, block.cache)[0]]
    rows = [block.hidden.shape[0] for block in blocks]
    for block, q in zip(blocks, rows):
        assert block.hidden.dim() == 2 and block.positions.shape == (q,), (block.hidden.shape, block.positions.shape)
        assert block.cache.pending == 0, "keep or drop the previous block before running a new one"
    query_len = max(rows)
    key_len = max(block.key_len for block in blocks)
    first = blocks[0].hidden
    hidden = first.new_zeros((len(blocks), query_len, first.shape[1]))  # [B, Q, d]
    # Padding rows repeat the block's last position: any valid position works, their outputs are dropped.
    position_ids = torch.empty((len(blocks), query_len), dtype=torch.long, device=first.device)  # [B, Q]
    for b, (block, q) in enumerate(zip(blocks, rows)):
        hidden[b, :q] = block.hidden
        position_ids[b, :q] = block.positions
        position_ids[b, q:] = block.positions[-1]
    masks = {w: batch_mask(blocks, query_len, key_len, hidden.dtype, w) for w in set(stack.windows)}
    cache = _BatchCache([block.cache for block in blocks], rows, key_len)
    out = stack.run_layers(hidden, position_ids, masks, cache)
    return [out[b, :q] for b, q in enumerate(rows)]


class LocalPasses:
    """Where a SessionTable gets its caches and runs its passes: here, this process's stack.

    The seam a tensor-parallel middle replaces (cloud/tensorparallel.py), whose caches and passes must
    be mirrored on every rank; the session table only ever calls these two methods.
    """

    def __init__(self, half: CloudHalf):
        self.half = half

    def new_cache(self, head_layers: int) -> KVCache:
        return self.half.stack_for(head_layers).new_cache()

    def run(self, head_layers: int, blocks: Sequence[Block]) -> list[torch.Tensor]:
        """`forward_blocks` over the layers a session of head depth `head_layers` runs."""
        return forward_blocks(self.half.stack_for(head_layers), blocks)
