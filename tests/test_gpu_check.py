"""scripts/gpu_check.sh's dry run on the CPU, with a tiny synthetic config: every step of the GPU check runs
(shards made in place, the cloud step, batching, the split on token ids with the server's steps through the
graphs' static pass, and the split with both halves on DEVICE), its folder holds at most 8 files
and no folder (what a lent GPU host sends back), and it states its travelling size, under 64 MiB."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiny import COMMON

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_gpu_check_runs_dry_on_the_cpu(tmp_path):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps({"model_type": "mistral", **COMMON}))
    out = tmp_path / "out"
    env = {**os.environ, "DEVICE": "cpu", "CONFIG": str(config), "SHARDS": str(tmp_path / "shards"), "PYTHON": sys.executable,
           "ROWS": "1,4", "CONTEXTS": "8", "SESSIONS": "1,2", "REPEATS": "2", "PROMPTS": "1", "MAX_NEW_TOKENS": "6",
           "RTT_MS": "20", "LOCAL_THREADS": "1", "LIMIT_SCALE": "2", "GRAPHS": "static"}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(out)], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:] + (out / "check.log").read_text()[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["batch.json", "check.log", "device-step.json", "split-gpu.json", "split.json", "summary.json"]
    assert all((out / f).is_file() for f in files) and len(files) <= 8
    summary = json.loads((out / "summary.json").read_text())
    assert [s["step"] for s in summary["steps"]] == ["wheels", "shards", "cloud-step", "batch", "split", "split-gpu"]
    assert summary["not_ok"] == [] and summary["travel"]["fits"] and "travelling size" in done.stderr
    step = json.loads((out / "device-step.json").read_text())
    assert step["synthetic"] and [r["rows"] for r in step["rows"]] == [1, 4] and step["rows"][0]["graph_ms"] is None
    assert all(r["serve_graphs"] == "static" and r["serve_graph_error"] is None and r["serve_graph_max_abs_diff"] < 1e-4
               for r in step["rows"])
    split = json.loads((out / "split.json").read_text())
    assert split["exact"] and split["strategies"] == ["sequential", "tree-nohead"] and split["synthetic"]
    assert split["cloud_graphs"] == "static" and split["local_device"] == "cpu"
    both = json.loads((out / "split-gpu.json").read_text())
    assert both["exact"] and both["local_device"] == "cpu" and both["cloud_graphs"] == "static"  # DEVICE=cpu here
    assert json.loads((out / "batch.json").read_text())["cloud"]["rows"]
