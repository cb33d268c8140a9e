"""The cloud step on an accelerator: eager and replayed as a captured CUDA graph, by block rows and context.

    python -m splitinfer.bench.devicestep --shard SHARDS/cloud --device cuda --dtype bfloat16 --out device-step.json

What `bench step` does for a CPU, for the cloud half on a GPU (scripts/gpu_check.sh runs it on a synthetic
7B-shaped shard): the middle layers on a `KVCache` prefilled with `context` rows, one block of q rows at a
time, timed with device events (median of `repeats` after a warm-up). Two ways:

- **eager**: `LayerStack.run_layers` as a server step runs it, a kernel launch at a time;
- **graph**: the same call captured once per (context, q) as a `torch.cuda.CUDAGraph` and replayed, which
  removes the launch gaps. The cache's buffers are reserved before the capture (a growth inside it would be
  a new allocation) and its length is the same on every replay (each block is truncated away), so the
  replayed graph writes and reads the rows the eager step does; its output is compared with eager's.
- **serve's graph**: the block through `LayerStack.forward` with `serve`'s graphs on (model/graphs.py: rows
  padded to a bucket, attention over the buffer's span, inputs refilled on the host each step): what `serve`
  runs on a CUDA device. On a CPU, their static pass uncaptured (the dry run checks it runs).

`--hop` adds the thread hop a server's step takes: one-row steps timed on the wall clock (synchronized),
called directly and through a one-thread executor as the server's compute path calls them, in this process
as it is and pinned to one core (as `bench batch` pins its cloud side). Beside both, the bytes bound: the layers' weights plus the cached keys/values read, over the device's
copy bandwidth measured here (a device-to-device copy, bytes read plus written). On a CPU (the dry run) the
graph column is null and the bandwidth is `bench/machine.py`'s. Inputs are seeded random rows: a step's
cost does not depend on values. This module knows nothing of sessions, the wire or the trusted side.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..masks import attention_mask
from ..model.shards import load_cloud
from ..model.stack import LayerStack
from ..options import Opt, check_args


def device_bandwidth_gbps(device: torch.device, repeats: int = 10) -> float:
    """Copy bandwidth of `device`, GB/s (bytes read plus bytes written); bench/machine.py's on a CPU."""
    if device.type != "cuda":
        from .machine import bandwidth_gbps

        return bandwidth_gbps()
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device).random_()  # 1 GiB, several times any L2
    dst = torch.empty_like(src)
    return 2 * src.numel() / timed(lambda: dst.copy_(src), device, repeats) / 1e6


def timed(run, device: torch.device, repeats: int, wall: bool = False) -> float:
    """Median ms of `run()` after one warm-up: device events on a GPU, the wall clock elsewhere or with `wall`
    (to the last kernel's end: synchronized on a GPU)."""
    run()
    times = []
    for _ in range(repeats):
        if device.type == "cuda" and not wall:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


class Block:
    """One (context, q) configuration on a prefilled cache: the step's inputs, built on the device once."""

    def __init__(self, stack: LayerStack, cache, context: int, q: int, generator: torch.Generator):
        param = next(stack.parameters())
        self.stack, self.cache, self.context = stack, cache, context
        self.hidden = torch.randn(1, q, stack.config.hidden_size, generator=generator).to(param)  # [1, q, d]
        positions = torch.arange(context, context + q, device=param.device)  # on the device, as a server's are
        allowed = np.tril(np.ones((q, q), dtype=bool))
        self.positions, self.allowed = positions, allowed
        self.position_ids = positions[None]  # [1, q]
        self.masks = {w: attention_mask(context, positions, allowed, param.dtype, window=w)
                      for w in set(stack.windows)}  # [1, 1, q, context + q]
        kv_heads, head_dim = stack.kv_heads_and_dim()
        cache.reserve(context + q, torch.empty((1, kv_heads, 0, head_dim), dtype=param.dtype, device=param.device))

    def eager(self) -> torch.Tensor:
        out = self.stack.run_layers(self.hidden, self.position_ids, self.masks, self.cache)  # [1, q, d]
        self.cache.truncate(self.context)
        return out

    def served(self) -> torch.Tensor:
        """The step as `serve` runs a lone block: `LayerStack.forward`, through the stack's graphs where on."""
        out = self.stack(self.hidden, self.positions, self.allowed, self.cache)
        self.cache.truncate(self.context)
        return out

    def graph(self):
        """(replay, output): the step captured as a CUDA graph (warmed up on a side stream first)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self.eager()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self.eager()
        return graph.replay, out


def thread_hop(block: Block, device: torch.device, repeats: int) -> dict:
    """Wall ms of a one-row step called directly and through a one-thread executor, unpinned and pinned."""
    from ..launch import pinned

    def hop(executor: ThreadPoolExecutor):
        return lambda: executor.submit(lambda: (block.eager(), torch.cuda.synchronize(device) if device.type == "cuda"
                                                else None)).result()

    out = {}
    for where in ("unpinned", "pinned"):
        with pinned(0 if where == "pinned" else None, torch.get_num_threads()), ThreadPoolExecutor(1) as executor:
            out[f"{where}_direct_ms"] = round(timed(block.eager, device, repeats, wall=True), 4)
            out[f"{where}_executor_ms"] = round(timed(hop(executor), device, repeats, wall=True), 4)
    return out


def serve_graph(block: Block, device: torch.device, repeats: int) -> dict:
    """The step through `serve`'s own graphs (model/graphs.py: padded to a bucket of rows, attending over the
    buffer's span); on a CPU their static pass, uncaptured. Its output against the eager step's."""
    row = {"serve_graph_ms": None, "serve_graph_max_abs_diff": None, "serve_graph_error": None,
           "serve_graphs": "captured" if device.type == "cuda" else "static"}
    try:
        row["serve_graph_ms"] = round(timed(block.served, device, repeats), 4)
        row["serve_graph_max_abs_diff"] = float((block.served().float() - block.eager().float()).abs().max())
    except Exception as exc:  # noqa: BLE001 - a capture that fails is a finding, recorded per row
        row["serve_graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return row


def prefill(stack: LayerStack, context: int, generator: torch.Generator):
    param = next(stack.parameters())
    cache = stack.new_cache()
    hidden = torch.randn(1, context, stack.config.hidden_size, generator=generator).to(param)
    stack(hidden, torch.arange(context, device=param.device), np.tril(np.ones((context, context), dtype=bool)), cache)
    cache.commit_all()
    return cache


def measure(stack: LayerStack, rows: list[int], contexts: list[int], repeats: int, log=print, hop: bool = False) -> dict:
    device = next(stack.parameters()).device
    gbps = device_bandwidth_gbps(device)
    weights = sum(p.numel() * p.element_size() for p in stack.parameters())
    generator = torch.Generator().manual_seed(0)
    results = []
    for context in contexts:
        stack.graphs = None  # the prefill eager
        cache = prefill(stack, context, generator)
        stack.use_graphs(capture=device.type == "cuda")
        for q in rows:
            block = Block(stack, cache, context, q, generator)
            row = {"context": context, "rows": q, "eager_ms": round(timed(block.eager, device, repeats), 4),
                   "bound_ms": round((weights + stack.kv_bytes_per_token() * context) / gbps / 1e6, 4),
                   "graph_ms": None, "graph_max_abs_diff": None, "graph_error": None}
            if device.type == "cuda":
                try:
                    replay, out = block.graph()
                    row["graph_ms"] = round(timed(replay, device, repeats), 4)
                    replay()
                    row["graph_max_abs_diff"] = float((out.float() - block.eager().float()).abs().max())
                    del replay, out
                except Exception as exc:  # noqa: BLE001 - a capture that fails is a finding, recorded per row
                    row["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
            row.update(serve_graph(block, device, repeats))
            if hop and q == 1:
                row["hop"] = thread_hop(block, device, repeats)
                log(f"thread hop ctx {context:>5}: {row['hop']}")
            results.append(row)
            log(f"cloud step ctx {context:>5} q {q:>2}: eager {row['eager_ms']} ms, graph {row['graph_ms']} ms, "
                f"serve's graph {row['serve_graph_ms']} ms, bound {row['bound_ms']} ms")
        cache.release()
    stack.graphs = None  # the stack as it came
    return {"device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "dtype": str(next(stack.parameters()).dtype).removeprefix("torch."), "layers": len(stack.layers),
            "weight_bytes": weights, "bandwidth_gbps": round(gbps, 1), "repeats": repeats, "rows": results}


@dataclass(frozen=True)
class DeviceStepOptions:
    """The defaults of `python -m splitinfer.bench.devicestep`."""

    device: str = "cuda"  # where the cloud layers run
    dtype: str = "bfloat16"  # their compute dtype (float16, bfloat16, float32)
    rows: str = "1,2,4,8,16,32,64"  # block rows, comma-separated
    contexts: str = "64,2048"  # cached tokens before the block, comma-separated
    repeats: int = 20  # timed steps of each configuration after a warm-up (median reported)
    hop: bool = False  # also time one-row steps through a one-thread executor, unpinned and pinned to one core


OPTIONS = (Opt("device"), Opt("dtype"), Opt("rows"), Opt("contexts"), Opt("repeats"), Opt("hop"))


def main(argv: list[str] | None = None) -> int:
    args = check_args(__doc__, ("--shard", "a cloud shard directory (OUT/cloud)"), DeviceStepOptions, OPTIONS, argv)
    half = load_cloud(args.shard, device=args.device, dtype=args.dtype, verify=False)
    result = measure(half.stack, [int(x) for x in args.rows.split(",")], [int(x) for x in args.contexts.split(",")],
                     args.repeats, log=lambda line: print(line, file=sys.stderr, flush=True), hop=args.hop)
    result.update(command="python -m splitinfer.bench.devicestep " + " ".join(sys.argv[1:] if argv is None else argv),
                  torch=torch.__version__, model_id=half.manifest["model_id"], synthetic=half.manifest.get("synthetic", False))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
