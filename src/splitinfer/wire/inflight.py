"""What a block in flight sees: the attention mask that follows from its assumption (pure functions).

A step that assumes earlier unresolved blocks accepted (`Step.assume`, protocol v3) runs on a cache that
holds, after the committed rows, every pending block it builds on, oldest first (kv.py `hold`). The block
sees the committed rows, the rows of each pending block that it assumes kept, and its own rows as its
structure allows; the rows it assumes dropped stay in the cache but are masked. Both sides build this
mask the same way: the client's head layers and the cloud's middle layers.

The mask reuses `masks.attention_mask` on one combined block (the pending rows, then the new block) and
keeps the new block's rows of it, so sliding windows and the additive convention are exactly a lone
step's. It knows nothing about sessions or the network.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..masks import attention_mask


@dataclass(frozen=True)
class Prefix:
    """The pending rows a block in flight is written after: their positions and which of them it sees."""

    positions: torch.Tensor  # [h] long, each pending row's absolute position (rows it does not see: any)
    visible: np.ndarray  # [h] bool, the rows the block assumes kept

    @classmethod
    def of(cls, blocks: list[tuple[tuple[int, ...], tuple[int, ...]]], device: torch.device | str = "cpu") -> "Prefix":
        """blocks: (positions, rows assumed kept) of each pending block, oldest first."""
        positions = [p for block_positions, _ in blocks for p in block_positions]
        visible = np.zeros(len(positions), dtype=bool)
        start = 0
        for block_positions, rows in blocks:
            visible[[start + r for r in rows]] = True
            start += len(block_positions)
        return cls(torch.tensor(positions, dtype=torch.long, device=device), visible)

    def __len__(self) -> int:
        return int(self.positions.shape[0])


def prefix_mask(
    committed: int, prefix: Prefix, positions: torch.Tensor, allowed: np.ndarray, dtype: torch.dtype,
    window: int | None = None,
) -> torch.Tensor:
    """Additive mask [1, 1, q, committed + h + q] of a block written after `prefix`'s h pending rows.

    positions: [q] long, the block's rows' positions; allowed: [q, q] bool, its in-block structure.
    """
    h, q = len(prefix), positions.shape[0]
    combined = np.zeros((h + q, h + q), dtype=bool)
    combined[:h, :h] = np.eye(h, dtype=bool)  # the pending rows' own mask rows are never used: any valid row
    combined[h:, :h] = prefix.visible[None, :]
    combined[h:, h:] = allowed
    every = torch.cat([prefix.positions.to(positions.device), positions])
    return attention_mask(committed, every, combined, dtype, window=window)[:, :, h:]
