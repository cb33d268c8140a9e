"""A lone block's pass through a LayerStack replayed as a CUDA graph, by bucket of rows and span of keys.

Eager on a GPU, a step of the middle layers is mostly kernel launches: notes/bench/gpu-h200 measured 18-26 ms
eager against 6-9 ms for the same call replayed as a graph. A graph fixes shapes and addresses, so here:

- a block of q rows is padded to the next bucket (1, 2, 4, ..., 64 rows); padding rows repeat the last
  position, see key 0 alone (softmax stays defined) and write their keys and values to the one slot after the
  block's rows, which no real row sees and the cache does not count (it holds q pending rows, as eager);
- every layer attends over its key buffer's whole capacity (the span), the mask hiding the slots past the
  block (zeroed when a graph is made for the buffers: a masked score is still computed, and unwritten memory
  may hold NaN); keys and values are written at slots read from a static index, so a graph serves every step of a
  session until the cache's buffers grow (the next step then captures again, for the new span);
- inputs are static tensors refilled before each replay; the output is copied out of the graph's buffer.

A graph belongs to one cache (its buffers' addresses): `StepGraphs` keeps them per cache, weakly, and forgets
those whose buffers moved. Blocks of more rows, batches of several sessions, held blocks and the layers that
attend row by row (`exact_rows`: int8/int4 weights, whose masks are read on the host) stay eager.

`capture=False` runs the same static pass without a graph, on any device: the CPU tests check its logic and
its outputs against the eager pass where no GPU is (tests/model/test_graphs.py).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..errors import ConfigError, ModelError
from ..kv import KVCache
from ..masks import attention_mask

log = logging.getLogger(__name__)

MODES = ("auto", "on", "off", "static")  # serve --graphs: auto is on where the layers sit on one CUDA device
BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # rows a graph takes; a block is padded to the first that holds it
SPARE_ROWS = 1  # the slot after a block's rows, where its padding rows write


class _SlotCache:
    """What a graphed pass hands the layers as their cache: each layer's keys and values written at `slots`
    (a static index) in the KVCache's buffers, and the whole buffers returned for attention."""

    def __init__(self, keys: list, values: list, slots: torch.Tensor):
        self.keys, self.values, self.slots = keys, values, slots

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys.index_copy_(2, self.slots, key)
        values.index_copy_(2, self.slots, value)
        return keys, values


@dataclass
class _Entry:
    """One captured pass: its static inputs, its output buffer and how to run it."""

    hidden: torch.Tensor  # [1, R, d]
    position_ids: torch.Tensor  # [1, R] long
    masks: dict  # {window: [1, 1, R, span]}
    slots: torch.Tensor  # [R] long
    buffers: tuple  # the cache buffers' addresses the pass was captured on
    replay: Callable[[], torch.Tensor] | None = None  # returns the output [1, R, d]


def bucket(rows: int) -> int:
    return next(b for b in BUCKETS if b >= rows)


class StepGraphs:
    """The graphs of one LayerStack's lone blocks (LayerStack.use_graphs)."""

    def __init__(self, stack, capture: bool):
        devices = set(stack.devices)
        if capture and (len(devices) != 1 or next(iter(devices)).type != "cuda"):
            raise ModelError("CUDA graphs need the middle layers on one CUDA device; use --graphs off (or static).")
        self.stack, self.capture = stack, capture
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self._graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # KVCache -> {(R, span): _Entry}
        self.captured = 0  # passes captured (or, without capture, static passes set up)
        self.replayed = 0
        self.eligible = not any(getattr(layer.self_attn, "exact_rows", False) for layer in stack.layers)

    def fits(self, hidden: torch.Tensor, cache) -> bool:
        """Whether a block [B, q, d] on `cache` takes a graph (else the eager pass)."""
        return (self.eligible and type(cache) is KVCache and hidden.shape[0] == 1 and hidden.shape[1] <= BUCKETS[-1]
                and not cache.held_rows and cache.num_layers == len(self.stack.layers))

    def run(self, hidden: torch.Tensor, positions: torch.Tensor, allowed: np.ndarray,
            cache: KVCache) -> torch.Tensor | None:
        """The block's output rows [1, q, d]; leaves the block pending in `cache`, as the eager pass does. None
        where the capture failed (the caller runs the block eager; every later block is eager too)."""
        q, rows = hidden.shape[1], bucket(hidden.shape[1])
        start = cache.length
        kv_heads, head_dim = self.stack.kv_heads_and_dim()
        like = hidden.new_empty((1, kv_heads, 0, head_dim))
        cache.reserve(start + q + SPARE_ROWS, like)
        keys, values, _ = cache.block_buffers(len(self.stack.layers), q, like)
        span = keys[0].shape[2]
        addresses = tuple(t.data_ptr() for t in keys + values)
        entries = self._graphs.setdefault(cache, {})
        entry = entries.get((rows, span))
        if entry is None or entry.buffers != addresses:
            for key in [k for k, e in entries.items() if e.buffers != addresses]:
                del entries[key]  # captured on buffers the cache has since replaced
            entry = entries[(rows, span)] = self._entry(rows, span, addresses, hidden)
            for buffer in keys + values:  # masked slots are read too: unwritten memory may hold NaN
                buffer[:, :, start:].zero_()
            self._fill(entry, hidden, positions, allowed, start, q)
            try:
                entry.replay = self._prepare(entry, keys, values)
            except RuntimeError as exc:  # a layer that cannot be captured: eager from now on, never a failed step
                del entries[(rows, span)]
                self.eligible = False
                log.warning("a CUDA graph of this stack's step failed to capture (%s); its steps run eager", exc)
                return None
            self.captured += 1
        else:
            self._fill(entry, hidden, positions, allowed, start, q)
        out = entry.replay() if self.capture else self._static_pass(entry, keys, values)
        self.replayed += 1
        return out[:, :q].clone()

    def _entry(self, rows: int, span: int, addresses: tuple, like: torch.Tensor) -> _Entry:
        device = like.device
        return _Entry(
            hidden=like.new_zeros((1, rows, like.shape[2])),
            position_ids=torch.zeros((1, rows), dtype=torch.long, device=device),
            masks={w: like.new_zeros((1, 1, rows, span)) for w in set(self.stack.windows)},
            slots=torch.zeros(rows, dtype=torch.long, device=device),
            buffers=addresses,
        )

    def _fill(self, entry: _Entry, hidden: torch.Tensor, positions: torch.Tensor, allowed: np.ndarray, start: int,
              q: int) -> None:
        """The block's rows, positions, slots and masks into the entry's static inputs (padding after them)."""
        rows, span = entry.hidden.shape[1], next(iter(entry.masks.values())).shape[-1]
        entry.hidden[:, :q].copy_(hidden)
        entry.hidden[:, q:].zero_()
        host = positions.cpu()
        padded = torch.cat([host, host[-1:].expand(rows - q)])
        entry.position_ids.copy_(padded[None])
        slots = torch.cat([torch.arange(start, start + q), torch.full((rows - q,), start + q)])
        entry.slots.copy_(slots)
        dtype = entry.hidden.dtype
        for window, mask in entry.masks.items():
            full = torch.full((1, 1, rows, span), torch.finfo(dtype).min, dtype=dtype)
            full[:, :, :q, : start + q] = attention_mask(start, host, allowed, dtype, window=window)
            full[:, :, q:, 0] = 0.0
            mask.copy_(full)

    def _static_pass(self, entry: _Entry, keys: list, values: list) -> torch.Tensor:
        """The captured computation, run eagerly on the static inputs (no graph)."""
        slot_cache = _SlotCache(keys, values, entry.slots)
        return self.stack._pass(entry.hidden, entry.position_ids, entry.masks, slot_cache)

    def _prepare(self, entry: _Entry, keys: list, values: list) -> Callable[[], torch.Tensor] | None:
        """Capture the entry's pass (warmed up on a side stream first, as CUDA graphs require); None without
        capture (`run` then calls the static pass itself, so no entry holds the cache's buffers)."""
        if not self.capture:
            return None
        slot_cache = _SlotCache(list(keys), list(values), entry.slots)
        run = lambda: self.stack._pass(entry.hidden, entry.position_ids, entry.masks, slot_cache)  # noqa: E731
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = run()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay

    def stats(self) -> dict:
        return {"captured": self.captured, "replayed": self.replayed, "capture": self.capture}


def use_graphs(stack, mode: str, several_devices: bool = False) -> None:
    """A stack's graphs as `serve --graphs MODE` asks (MODES): auto, where its layers sit on one CUDA device."""
    on_cuda = all(device.type == "cuda" for device in stack.devices) and not several_devices
    if mode == "off" or (mode == "auto" and (not on_cuda or stack.compile_rows)):
        return
    if mode == "on" and not on_cuda:
        raise ConfigError("--graphs on needs the middle layers on one CUDA device (--device cuda, no --devices); "
                          "--graphs static runs their static-shape pass anywhere.")
    stack.use_graphs(capture=mode != "static")
    if not stack.graphs.eligible:
        log.warning("this shard's layers attend row by row (integer weights): steps stay eager, without graphs")
    log.info("steps of up to 64 rows: %s", "CUDA graphs by bucket of rows" if mode != "static"
             else "the graphs' static-shape pass, uncaptured")
