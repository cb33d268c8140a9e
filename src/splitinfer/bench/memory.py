"""`splitinfer bench memory`: the resident memory a loaded half adds, against the bytes its shard stores: each half
loaded alone, in a fresh process, as `serve` (the cloud half) and a client (the local half) load it.

For each shard directory and half: the process's resident set (anonymous and file-backed, /proc/self/status)
just before `load_cloud` / `load_local` (torch, transformers and the kernels already imported and built), just
after it, and after one step of one row (every weight read once: weights that stay in the file's mapping, float
ones, are resident only once read), against the size of the half's weights file. Linux only.
Writes OUT/memory.json and OUT/memory.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ..errors import ConfigError
from ..tables import table
from .harness import command_line, write

CHILD = """
import json, sys
from pathlib import Path
import numpy as np
import torch
from splitinfer import kernels
from splitinfer.model.shards import load_cloud, load_local

def rss_mb():
    fields = dict(l.split(":", 1) for l in Path("/proc/self/status").read_text().splitlines() if ":" in l)
    return {k: int(fields[k].split()[0]) / 1024 for k in ("RssAnon", "RssFile")}

kernels.ensure()  # the kernels built and loaded before the first reading
directory, half = Path(sys.argv[1]), sys.argv[2]
before = rss_mb()
loaded = (load_cloud if half == "cloud" else load_local)(directory / half, verify=False)
loaded_mb = rss_mb()
with torch.inference_mode():  # one step of one row: every weight read once (a file-backed one paged in)
    one, allowed = torch.zeros(1, dtype=torch.long), np.ones((1, 1), dtype=bool)
    if half == "cloud":
        stack = loaded.stack
        stack(torch.zeros(1, 1, loaded.config.hidden_size), one, allowed, stack.new_cache())
    else:
        x = loaded.embed(one[None])
        for stack in (loaded.head, loaded.tail):
            x = stack(x, one, allowed, stack.new_cache())
        loaded.logits(x)
print(json.dumps({"before": before, "loaded": loaded_mb, "after": rss_mb()}))
"""


def measure(shards: Path, half: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    out = subprocess.run([sys.executable, "-c", CHILD, str(shards), half], capture_output=True, text=True, check=True,
                         env=env)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    stored = (shards / half / "weights.safetensors").stat().st_size / 2**20
    added = {kind: round(row["after"][kind] - row["before"][kind], 1) for kind in ("RssAnon", "RssFile")}
    return {"shards": str(shards), "half": half, "file_mib": round(stored, 1), **row,
            "added_anon_mib": added["RssAnon"], "added_file_mib": added["RssFile"],
            "anon_over_file": round(added["RssAnon"] / stored, 2)}


def run(args, log=print) -> dict:
    if not Path("/proc/self/status").is_file():
        raise ConfigError("bench memory reads the resident set from /proc/self/status: Linux only.")
    rows = [measure(Path(s), half) for s in args.shards.split(",") if s for half in ("cloud", "local")]
    body = ["Each half loaded alone in a fresh process, then one step of one row; MiB the process's resident set grew "
            "by from before `load_cloud` / `load_local` to after the step: anonymous memory (its own: packed weights, "
            "what the allocator kept) and file-backed (the shard's pages it mapped and read: clean, shared with the "
            "page cache, which the kernel may reclaim and read again), against the size of the half's weights file.",
            "", *table(["shards", "half", "weights file MiB", "anonymous MiB", "anonymous / file", "file-backed MiB"],
                       [[r["shards"], r["half"], r["file_mib"], r["added_anon_mib"], f"{r['anon_over_file']}x",
                         r["added_file_mib"]] for r in rows], "|---|---|---:|---:|---:|---:|")]
    write(Path(args.out), "memory", {"rows": rows}, body, title="Resident memory a loaded half adds",
          command=command_line(args), log=log)
    return {"rows": rows}
