"""Two sessions on one in-process server (int8 shard, float16 wire), each stepping one row every 80 ms plus
its step (an 80 ms round trip): started 40 ms apart (out of phase), then together (they drift apart: the
second waits behind the first one's pass once, then each comes while the other's client waits). Prints the median step as the client sees it and the server's handling time beyond its compute (the
batch window, the queue, the hand-offs). Run from the repository root; SRC picks the source tree:

    .venv/bin/python notes/bench/batching-int8/phase.py                      # the working tree
    SRC=/path/to/committed/src .venv/bin/python notes/bench/batching-int8/phase.py
"""
import json, os, statistics, sys, threading, time
from pathlib import Path

sys.path.insert(0, os.environ.get("SRC", "src"))
import torch

from splitinfer.cloud.server import ServerConfig, ServerThread
from splitinfer.local.middle import RemoteMiddle
from splitinfer.masks import BlockStructure
from splitinfer.model.shards import load_cloud
from splitinfer.wire.messages import Step

torch.set_num_threads(1)
shard = Path("shards/formats/int8")
half = load_cloud(shard / "cloud")
manifest = json.loads((shard / "cloud/manifest.json").read_text())
d = half.config.hidden_size


def client(url, steps, delay, think, out):
    middle = RemoteMiddle.for_shard(url, manifest, d, "float16")
    middle.open()
    middle.step(Step(0, (), tuple(range(16)), BlockStructure.chain(), torch.randn(16, d).half(), "float16"))
    keep = tuple(range(16))
    time.sleep(delay)
    for i in range(steps):
        t0 = time.perf_counter()
        r, _ = middle.step(Step(i + 1, keep, (16 + i,), BlockStructure.chain(), torch.randn(1, d).half(), "float16"))
        out.append(((time.perf_counter() - t0) * 1e3, r.handle_ms - r.compute_ms))
        keep = (0,)
        time.sleep(think)
    middle.close()


with ServerThread(half, ServerConfig(port=0)) as server:
    for name, delays in (("out of phase", (0, 0.04)), ("started together", (0, 0))):
        outs = [[], []]
        threads = [threading.Thread(target=client, args=(server.url, 30, delay, 0.08, out)) for delay, out in zip(delays, outs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        steps = outs[0] + outs[1]
        beyond = sorted(h for _, h in steps)
        print("  beyond-compute deciles", [round(beyond[int(q * (len(beyond) - 1))], 2) for q in (0.1, .3, .5, .7, .9)])
        print(f"{name}: step {statistics.median(s for s, _ in steps):.3f} ms, server handling beyond compute "
              f"{statistics.median(h for _, h in steps):.3f} ms; scheduler {server.server.scheduler.stats()}")
        time.sleep(1.1)  # past the active horizon: the next pair starts on a quiet server
