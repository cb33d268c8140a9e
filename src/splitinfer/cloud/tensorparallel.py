"""`serve --tp N`: one server whose middle layers are split over N ranks (model/tensorparallel.py).

Rank roles. Rank 0 is an ordinary CloudServer: it owns the WebSocket, the session table, the budgets and
the scheduler, and it validates every step. The other ranks hold no socket and no session table: only
their slice of the layers and their slice of every session's KV cache, keyed by an id rank 0 assigns.

What is broadcast. Rank 0's table makes caches and runs passes through `Rank0Passes` (the seam that
`LocalPasses` in batch.py stands for). Every change rank 0 makes to a cache outside a pass (rows kept after
verification, so a rejected speculative block is dropped everywhere; a truncation; a release on close,
expiry or eviction) is logged by the cache itself (`MirroredCache`) and sent ahead of the next pass; a
release is sent at once, so that activations do not outlive their session on any rank. A pass goes out as
its head depth and each block's cache id and row count (a JSON header), then positions, in-block
visibility and hidden rows (plain tensors; nothing is pickled); then every rank runs the same
`forward_blocks` on its slice, and the all-reduces inside the layers meet. A cache a worker has not seen
is created when first named, so opening a session needs no message.

Every message on the group goes out under one lock, so all ranks see one sequence of collectives. A
worker whose broadcast fails (rank 0 is gone) stops; torchrun stops the whole group when any rank exits
with an error. This module knows nothing about the wire protocol or the HTTP side of the server.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import sys
import threading
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import torch

from ..errors import ConfigError
from ..kv import KVCache
from .batch import Block, LocalPasses, forward_blocks

log = logging.getLogger("splitinfer.cloud")

# An idle server sends nothing for as long as no client steps, while the workers wait in a broadcast: the
# group's timeout must outlast any idle spell. A dead rank is caught by torchrun, not by this timeout.
GROUP_TIMEOUT = timedelta(days=365)


class MirroredCache(KVCache):
    """Rank 0's KVCache of one session: every change outside a pass is logged for the other ranks."""

    def __init__(self, num_layers: int, cache_id: int, passes: Rank0Passes):
        super().__init__(num_layers)
        self.id = cache_id
        self._passes = passes

    def keep(self, rows: Sequence[int]) -> None:
        rows = [int(r) for r in rows]
        super().keep(rows)  # logged only once it succeeded here: a refused keep changes nothing anywhere
        self._passes.record(["keep", self.id, rows])

    def truncate(self, length: int) -> None:
        super().truncate(length)
        self._passes.record(["truncate", self.id, int(length)])

    def hold(self) -> None:
        super().hold()
        self._passes.record(["hold", self.id])

    def drop_newer(self, blocks: int) -> None:
        super().drop_newer(blocks)
        self._passes.record(["drop_newer", self.id, int(blocks)])

    def release(self) -> None:
        super().release()
        self._passes.record(["release", self.id], now=True)


def _send_header(header: dict, device: torch.device, group) -> None:
    import torch.distributed as dist

    data = json.dumps(header, separators=(",", ":")).encode()
    dist.broadcast(torch.tensor([len(data)], dtype=torch.long, device=device), src=0, group=group)
    dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device), src=0, group=group)


def _receive_header(device: torch.device, group) -> dict:
    import torch.distributed as dist

    length = torch.zeros(1, dtype=torch.long, device=device)
    dist.broadcast(length, src=0, group=group)
    data = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=0, group=group)
    return json.loads(data.cpu().numpy().tobytes())


class Rank0Passes(LocalPasses):
    """Rank 0's caches and passes: each pass (and every cache change before it) is sent to all ranks."""

    def __init__(self, half, group=None):
        super().__init__(half)
        self.group = group
        self.device = next(half.stack.parameters()).device
        self._ids = itertools.count()
        self._ops: list[list] = []  # cache changes not yet sent, in the order they happened
        self._ops_lock = threading.Lock()
        self._group_lock = threading.Lock()  # one message on the group at a time, a pass's collectives included
        self.messages = 0  # messages sent to the other ranks (passes and cache changes)

    def new_cache(self, head_layers: int) -> MirroredCache:
        return MirroredCache(super().new_cache(head_layers).num_layers, next(self._ids), self)

    def record(self, op: list, now: bool = False) -> None:
        with self._ops_lock:
            self._ops.append(op)
        if now:
            self._drain()

    def _take_ops(self) -> list[list]:
        with self._ops_lock:
            ops, self._ops = self._ops, []
        return ops

    def _drain(self) -> None:
        """Send logged changes now, unless a message is going out: its sender drains after it."""
        while self._ops:
            if not self._group_lock.acquire(blocking=False):
                return
            try:
                ops = self._take_ops()
                if ops:
                    _send_header({"ops": ops}, self.device, self.group)
                    self.messages += 1
            finally:
                self._group_lock.release()

    def run(self, head_layers: int, blocks: Sequence[Block]) -> list[torch.Tensor]:
        assert all(isinstance(b.cache, MirroredCache) for b in blocks), "caches must come from new_cache"
        # A block in flight's prefix is not broadcast: serve --tp admits one block per session at a time.
        assert all(b.prefix is None for b in blocks), "serve --tp runs sessions with max_in_flight = 1"
        import torch.distributed as dist

        spec = {"depth": head_layers, "blocks": [[b.cache.id, int(b.positions.shape[0])] for b in blocks]}
        positions = torch.cat([b.positions for b in blocks]).to(self.device)  # [R] long
        allowed = torch.cat([torch.from_numpy(b.allowed.astype("uint8")).reshape(-1) for b in blocks])
        hidden = torch.cat([b.hidden for b in blocks]).to(self.device)  # [R, d]
        with self._group_lock:
            _send_header({"ops": self._take_ops(), "pass": spec}, self.device, self.group)
            for tensor in (positions, allowed.to(self.device), hidden):
                dist.broadcast(tensor, src=0, group=self.group)
            self.messages += 1
            outs = super().run(head_layers, blocks)
        self._drain()
        return outs

    def stop_workers(self) -> None:
        """Tell the other ranks to stop (best effort: ranks that are already gone are not waited for)."""
        with self._group_lock:
            try:
                _send_header({"ops": self._take_ops(), "stop": True}, self.device, self.group)
            except RuntimeError as exc:
                log.info("the other ranks were already gone (%s)", exc)


def _apply(caches: dict[int, KVCache], slots: int, op: list) -> None:
    kind, cache_id = op[0], op[1]
    if kind == "release":
        cache = caches.pop(cache_id, None)
        if cache is not None:
            cache.release()
        return
    cache = caches.setdefault(cache_id, KVCache(slots))
    if kind == "keep":
        cache.keep(op[2])
    elif kind == "truncate":
        cache.truncate(op[2])
    elif kind == "hold":
        cache.hold()
    elif kind == "drop_newer":
        cache.drop_newer(op[2])
    else:
        raise RuntimeError(f"rank 0 sent an unknown cache change {kind!r}; the ranks run different versions.")


def _receive_pass(half, caches: dict[int, KVCache], slots: int, spec: dict, device, group) -> list[Block]:
    import torch.distributed as dist

    rows = [q for _, q in spec["blocks"]]
    positions = torch.empty(sum(rows), dtype=torch.long, device=device)
    allowed = torch.empty(sum(q * q for q in rows), dtype=torch.uint8, device=device)
    param = next(half.stack.parameters())
    hidden = torch.empty((sum(rows), half.config.hidden_size), dtype=param.dtype, device=device)
    for tensor in (positions, allowed, hidden):
        dist.broadcast(tensor, src=0, group=group)
    allowed = allowed.cpu().numpy().astype(bool)
    blocks, row, cell = [], 0, 0
    for (cache_id, q) in spec["blocks"]:
        cache = caches.setdefault(cache_id, KVCache(slots))
        visible = allowed[cell : cell + q * q].reshape(q, q)
        blocks.append(Block(hidden[row : row + q], positions[row : row + q], visible, cache))
        row, cell = row + q, cell + q * q
    return blocks


def worker_loop(half, group=None, caches: dict[int, KVCache] | None = None) -> None:
    """A rank other than 0: mirror rank 0's cache changes and run its passes on this rank's slice, until
    rank 0 says stop or goes away. `caches` (cache id -> this rank's KVCache) may be passed in to be read."""
    caches = {} if caches is None else caches
    slots = len(half.stack.layers)
    device = next(half.stack.parameters()).device
    while True:
        try:
            header = _receive_header(device, group)
            for op in header.get("ops", ()):
                _apply(caches, slots, op)
            if header.get("stop"):
                return
            blocks = _receive_pass(half, caches, slots, header["pass"], device, group) if "pass" in header else []
        except RuntimeError as exc:  # a collective failed: rank 0 is gone, the group is over
            log.info("rank 0 is gone (%s); this rank stops", exc)
            return
        if blocks:
            try:
                forward_blocks(half.stack_for(header["pass"]["depth"]), blocks)
            except Exception:  # noqa: BLE001 - rank 0 failed the same pass for its steps and serves on
                log.exception("a mirrored pass of %d block(s) failed", len(blocks))


# -- launching -------------------------------------------------------------------------------------------
def check_launch(shard: str, world: int, device: str) -> None:
    """Everything `serve --tp` can check before starting processes: the split, and torch.distributed."""
    import torch.distributed as dist

    from ..model.manifest import read_manifest
    from ..model.stack import config_from_dict
    from ..model.tensorparallel import check_divisible, tp_plan

    if world < 1:
        raise ConfigError("--tp must be at least 1.")
    if device.startswith("cuda:"):
        raise ConfigError("with --tp every rank takes the GPU of its local rank; give --device cuda, not a GPU index.")
    read_manifest(Path(shard), "cloud")  # a clear error for a missing or wrong shard
    config = config_from_dict(json.loads((Path(shard) / "config.json").read_text()))
    check_divisible(config, world)
    tp_plan(config)
    if not dist.is_available():
        raise ConfigError("this torch build has no torch.distributed, which --tp needs; install a torch wheel from "
                          "PyPI (they include it) or serve without --tp.")
    if device.startswith("cuda") and not dist.is_nccl_available():
        raise ConfigError("--tp on GPUs needs torch.distributed's NCCL backend, which this torch build lacks.")
    if not device.startswith("cuda") and not dist.is_gloo_available():
        raise ConfigError("--tp on CPU needs torch.distributed's gloo backend, which this torch build lacks.")


def relaunch_under_torchrun(world: int, argv: Sequence[str]) -> None:
    """Replace this process by torchrun running `world` copies of this very command (does not return)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               "-m", "splitinfer", *argv]
    log.info("starting %d ranks: %s", world, " ".join(command))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, command)


def join_group(world: int, device: str) -> tuple[int, str]:
    """Join torchrun's process group as one of `world` ranks; returns (rank, this rank's device)."""
    import torch.distributed as dist

    if int(os.environ["WORLD_SIZE"]) != world:
        raise ConfigError(f"torchrun started {os.environ['WORLD_SIZE']} processes but --tp says {world}; "
                          "give torchrun --nproc-per-node equal to --tp (or let `serve --tp` start torchrun).")
    if device.startswith("cuda"):
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", timeout=GROUP_TIMEOUT)
    return dist.get_rank(), device


def load_rank(shard: str, rank: int, world: int, device: str, dtype: str | None):
    """This rank's slice of the cloud shard: loaded on the CPU, cut, then moved to `device`."""
    from ..model.shards import load_cloud
    from ..model.tensorparallel import shard_stack

    half = load_cloud(shard, device="cpu", dtype=dtype)
    shard_stack(half.stack, rank, world)
    half.stack.to(device)
    half.stack.refresh_devices()
    return half
