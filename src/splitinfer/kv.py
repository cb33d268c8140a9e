"""The KV cache object both sides use: committed rows, pending blocks, keep-these-rows, truncate.

A forward pass over a block of q rows writes the block's keys and values after the `length` committed
rows and leaves them *pending*. Once the client knows which block rows were accepted, `keep(rows)` moves
those rows into place and drops the rest (lazy commit: the keep list rides in the next request's header, so it costs no round trip; docs/design.md,
"Blocks, masks and the KV cache"). Committed rows always hold
positions 0..length-1, because an accepted path is contiguous.

With blocks in flight, a block can run before the one before it is resolved: `hold()` keeps the pending
block pending and lets the next block be written after it. Held blocks are resolved oldest first (`keep`
then moves the kept rows into place and shifts every later pending row down after them), and
`drop_newer(n)` forgets every pending block but the n oldest held ones (their assumption failed).

The object duck-types the single method HF attention layers call on a cache (`update`); it knows nothing
about masks, positions or the network.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class KVCache:
    """Per-layer key/value buffers of shape [1, kv_heads, capacity, head_dim], grown by doubling."""

    def __init__(self, num_layers: int, initial_capacity: int = 256):
        self.num_layers = num_layers
        self.length = 0  # committed rows
        self.pending = 0  # rows of the last block, not yet kept or dropped
        self.held: list[int] = []  # rows of earlier pending blocks, oldest first, stored before the last block
        self._held_rows = 0  # sum(held)
        self._capacity = initial_capacity
        self._keys: list[torch.Tensor | None] = [None] * num_layers
        self._values: list[torch.Tensor | None] = [None] * num_layers

    # Called by HF attention modules. Extra positional/keyword arguments differ across transformers
    # releases (cache_kwargs, kwargs=...); none of them matters to a plain full-attention cache.
    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        # key, value: [1, kv_heads, q, head_dim]
        q = key.shape[2]
        keys, values, start = self.slots(layer_idx, q, key)
        keys[:, :, start : start + q] = key
        values[:, :, start : start + q] = value
        return keys[:, :, : start + q], values[:, :, : start + q]

    def slots(self, layer_idx: int, rows: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Layer `layer_idx`'s whole key and value buffers, grown to take a block of `rows` rows, and the slot
        the block starts at; the block is pending from here on (its writer fills slots [start, start + rows)).
        like: a [1, kv_heads, *, head_dim] tensor of the buffers' dtype and device."""
        start = self.length + self._held_rows
        keys, values = self._keys[layer_idx], self._values[layer_idx]
        if keys is None or keys.shape[2] < start + rows:
            keys, values = self._grow(layer_idx, like, start + rows)
        self.pending = rows
        return keys, values, start

    def block_buffers(self, layers: int, rows: int, like: torch.Tensor) -> tuple[list, list, int]:
        """`slots` for layers 0..layers-1 at once (a writer that fills them all in one call): their key and value
        buffers, grown to take a block of `rows` rows, and the slot the block starts at."""
        start = self.length + self._held_rows
        for layer_idx in range(layers):
            keys = self._keys[layer_idx]
            if keys is None or keys.shape[2] < start + rows:
                self._grow(layer_idx, like, start + rows)
        self.pending = rows
        return self._keys[:layers], self._values[:layers], start

    def capacity_for(self, rows: int) -> int:
        """Rows each layer's buffer holds once `rows` rows have been written (the growth rule of `_grow`)."""
        capacity = max(self._capacity, 16)
        while capacity < rows:
            capacity *= 2
        return capacity

    def projected_nbytes(self, rows: int, bytes_per_row: int) -> int:
        """Bytes the buffers will hold after writing up to `rows` rows; `bytes_per_row` covers all layers.

        Buffers never shrink while the cache lives, so this is what a memory budget must reserve.
        """
        if rows == 0 and all(k is None for k in self._keys):
            return 0
        return self.capacity_for(rows) * bytes_per_row

    def reserve(self, rows: int, like: torch.Tensor) -> None:
        """Make every layer's buffers hold `rows` rows before a pass writes them, so `update` never grows
        them inside the pass (a compiled pass then keeps one graph). like: a [1, kv_heads, 0, head_dim]
        tensor of the buffers' dtype and device."""
        for layer_idx, keys in enumerate(self._keys):
            if keys is None or keys.shape[2] < rows:
                self._grow(layer_idx, like, rows)

    def _grow(self, layer_idx: int, key: torch.Tensor, needed: int):
        capacity = self.capacity_for(needed)
        self._capacity = capacity
        shape = (key.shape[0], key.shape[1], capacity, key.shape[3])
        keys = key.new_empty(shape)
        values = key.new_empty(shape)
        old_k, old_v = self._keys[layer_idx], self._values[layer_idx]
        if old_k is not None:
            kept = self.length + self._held_rows
            keys[:, :, :kept] = old_k[:, :, :kept]
            values[:, :, :kept] = old_v[:, :, :kept]
        self._keys[layer_idx], self._values[layer_idx] = keys, values
        return keys, values

    @property
    def held_rows(self) -> int:
        """Rows of the held blocks (pending, waiting for their resolution behind the last block)."""
        return self._held_rows

    def hold(self) -> None:
        """Keep the last block pending; the next block is written after it (a block in flight)."""
        if self.pending:
            self.held.append(self.pending)
            self._held_rows += self.pending
            self.pending = 0

    @torch.inference_mode()  # the buffers are inference tensors (created under inference mode)
    def keep(self, rows: Sequence[int]) -> None:
        """Commit the given rows (ascending block indices) of the oldest pending block, drop its others; the
        oldest pending block is the oldest held one if any, else the last block."""
        rows = list(rows)
        size = self.held[0] if self.held else self.pending
        assert all(0 <= r < size for r in rows), (rows, size)
        assert rows == sorted(set(rows)), rows
        n = len(rows)
        later = self._held_rows - size + self.pending if self.held else 0  # pending rows stored after this block
        if (n and rows != list(range(n))) or (later and n != size):
            index = torch.tensor(rows, dtype=torch.long) + self.length
            for buffers in (self._keys, self._values):
                for buf in buffers:
                    if buf is None:
                        continue
                    if n and rows != list(range(n)):
                        buf[:, :, self.length : self.length + n] = buf.index_select(2, index.to(buf.device))
                    if later and n != size:
                        start = self.length + size
                        buf[:, :, self.length + n : self.length + n + later] = buf[:, :, start : start + later].clone()
        self.length += n
        if self.held:
            self._held_rows -= self.held.pop(0)
        else:
            self.pending = 0

    def drop_newer(self, blocks: int) -> None:
        """Keep the `blocks` oldest held blocks pending; forget every later pending block."""
        assert 0 <= blocks <= len(self.held), (blocks, self.held)
        self.held = self.held[:blocks]
        self._held_rows = sum(self.held)
        self.pending = 0

    def commit_all(self) -> None:
        self.keep(range(self.pending))

    def truncate(self, length: int) -> None:
        """Forget every row at or after `length` (and any pending block)."""
        assert 0 <= length <= self.length, (length, self.length)
        self.length = length
        self.pending = 0
        self.held, self._held_rows = [], 0

    def release(self) -> None:
        """Free the buffers (the session is gone); the cache is empty afterwards and may be reused."""
        self._keys = [None] * self.num_layers
        self._values = [None] * self.num_layers
        self.length = self.pending = 0
        self.held, self._held_rows = [], 0

    def nbytes(self) -> int:
        """Bytes held by the buffers (allocated capacity, not only used rows)."""
        return sum(b.numel() * b.element_size() for b in self._keys + self._values if b is not None)
