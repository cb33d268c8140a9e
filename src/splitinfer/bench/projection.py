"""`splitinfer bench project`: a projection, not a measurement: what a stored `bench spec` run's strategies would
reach with the cloud layers on a GPU, from the run's own bound.

`bench spec` writes each strategy's bound, 1000 a / (RTT + local + cloud + drafting), with a (emitted tokens per
step) and the per-step costs measured in that run. This keeps a, the round trip, the trusted side's local and
drafting costs as measured (the trusted machine stays a CPU) and puts an assumed cloud step cost in the measured
one's place, for each of --cloud-ms; a second figure also takes drafting off the critical path (drafting the next
tree while a block is on the network: the ceiling of that change). The floor of any GPU's cloud step is the time
to read the cloud layers' weights once: its weights in 16 bits over --bandwidth-gbs (H200's published 4.8 TB/s of
HBM3e by default), given beside the table. Nothing here ran on a GPU: label every figure a projection.
`--paper` makes the table for the paper's configuration instead (paper_projection.py).
Writes OUT/projection.json and OUT/projection.md (and, with --paper, OUT/projection.png).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ConfigError
from ..tables import table
from .harness import command_line, write


def project(bound: dict, cloud_ms: float, drafting: bool = True) -> float:
    """tok/s of the bound with the cloud step costing `cloud_ms` (and drafting on the critical path or not)."""
    step = bound["rtt_ms"] + bound["local_ms"] + cloud_ms + (bound["drafting_ms"] if drafting else 0.0)
    return round(1000 * bound["a"] / step, 2)


def weights_floor_ms(shard: Path, bytes_per_weight: int, bandwidth_gbs: float) -> float:
    """ms to read the cloud shard's weights once at `bytes_per_weight` (the stored shard is float32)."""
    stored = sum(f.stat().st_size for f in shard.glob("*.safetensors"))
    return round(stored / 4 * bytes_per_weight / (bandwidth_gbs * 1e9) * 1000, 4)


def rows(run: dict, cloud_ms: list[float]) -> list[dict]:
    out = []
    for row in run["summary"]["rows"]:
        bound = row["bound"]
        out.append({"strategy": row["strategy"], "rtt_ms": bound["rtt_ms"], "a": bound["a"], "measured_bound": bound,
                    "measured_tokens_per_s": row["tokens_per_s_whole_set"],
                    "projected": [{"cloud_ms": c, "tokens_per_s": project(bound, c),
                                   "drafting_off_path_tokens_per_s": project(bound, c, drafting=False)} for c in cloud_ms]})
    return out


def body(result: dict) -> list[str]:
    head = ["strategy", "RTT ms", "a", "local ms", "drafting ms", "measured (CPU cloud)"]
    costs = [p["cloud_ms"] for p in result["rows"][0]["projected"]]
    head += [f"cloud {c:g} ms" for c in costs] + [f"cloud {c:g} ms, drafting off the path" for c in costs]
    cells = []
    for r in result["rows"]:
        b = r["measured_bound"]
        cells.append([r["strategy"], f"{r['rtt_ms']:g}", r["a"], b["local_ms"], b["drafting_ms"], r["measured_tokens_per_s"],
                      *(p["tokens_per_s"] for p in r["projected"]),
                      *(p["drafting_off_path_tokens_per_s"] for p in r["projected"])])
    return [f"From: `{result['run']}` ({result['run_command']})", "",
            f"Weights floor of one cloud step: {result['weights_floor_ms']} ms ({result['shard']} at 2 bytes a "
            f"weight over {result['bandwidth_gbs']:g} GB/s).", "", *table(head, cells)]


def run(args, log=print) -> dict:
    if args.paper:
        from .paper_projection import run_paper

        return run_paper(args, log)
    try:
        spec = json.loads(Path(args.run).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {args.run} ({exc}); give a `bench spec` speculative.json.") from exc
    shard = Path(args.shards) / "cloud"
    result = {"run": args.run, "run_command": spec["command"], "shard": str(shard), "bandwidth_gbs": args.bandwidth_gbs,
              "weights_floor_ms": weights_floor_ms(shard, 2, args.bandwidth_gbs),
              "rows": rows(spec, [float(c) for c in args.cloud_ms.split(",")])}
    write(Path(args.out), "projection", result, body(result), title="A GPU cloud, projected (not measured)",
          command=command_line(args), log=log)
    return result
