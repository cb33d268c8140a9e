"""A projection, not a measurement: what a stored `bench spec` run's strategies would reach with the cloud
layers on a GPU, from the run's own bound.

    python scripts/gpu_projection.py notes/bench/mtbench-spec/speculative.json --out notes/bench/gpu-projection

`bench spec` writes each strategy's bound, 1000 a / (RTT + local + cloud + drafting), with a (emitted
tokens per step) and the per-step costs measured in that run. This keeps a, the round trip, the trusted
side's local and drafting costs as measured (the trusted machine stays a CPU) and puts an assumed cloud
step cost in the measured one's place, for each of --cloud-ms; a second figure also takes drafting off the
critical path (drafting the next tree while a block is on the network: the ceiling of that change). The
floor of any GPU's cloud step is the time to read the cloud layers' weights once: its weights in 16 bits
over --bandwidth-gbs (H200's published 4.8 TB/s of HBM3e by default), printed beside the table.
Nothing here ran on a GPU: label every figure a projection.

`--paper` makes the table for the paper's configuration instead (mistral-7b-v0.1, 2 + 2 local layers; issue
49), at --paper-rtts (20, 50, 80 and 150 ms), each input labelled measured, scaled or bound:

    python scripts/gpu_projection.py --paper notes/bench/mtbench-spec/speculative.json \
        --trusted notes/bench/trusted-7b/trusted-half.json [--device-step GPU_OUT/device-step.json] \
        --out notes/bench/paper-projection

tok/s = 1000 a / (RTT + local + cloud + drafting), with a and drafting measured on the shipped model's
MT-Bench run (the tree's rows a step too); local: the 7B trusted half's step at those rows and the run's mean
context, measured on this CPU by scripts/bench_trusted_half.py (`--trusted`; without it, its bytes bound at
this CPU's measured bandwidth), and the same scaled to a laptop by bandwidth (--laptop-gbs, assumed); cloud:
the GPU check's measured cloud step (`--device-step`; without it, the cloud layers' bfloat16 bytes over
--bandwidth-gbs, a bound). The paper's own figures (its measured 8.3 sequential and 8.8 lookahead tok/s at
~78-80 ms, its projected ones at 20 and 150 ms, its 26.2 ms RTX 3090 and 15.9 ms A100 steps) stand beside.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from splitinfer.tables import table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paper_projection import add_paper_options, paper_main  # noqa: E402


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


def markdown(result: dict) -> str:
    head = ["strategy", "RTT ms", "a", "local ms", "drafting ms", "measured (CPU cloud)"]
    costs = [p["cloud_ms"] for p in result["rows"][0]["projected"]]
    head += [f"cloud {c:g} ms" for c in costs] + [f"cloud {c:g} ms, drafting off the path" for c in costs]
    cells = []
    for r in result["rows"]:
        b = r["measured_bound"]
        cells.append([r["strategy"], f"{r['rtt_ms']:g}", r["a"], b["local_ms"], b["drafting_ms"], r["measured_tokens_per_s"],
                      *(p["tokens_per_s"] for p in r["projected"]),
                      *(p["drafting_off_path_tokens_per_s"] for p in r["projected"])])
    lines = ["# A GPU cloud, projected (not measured)", "", f"Command: `{result['command']}`", "",
             f"From: `{result['run']}` ({result['run_command']})", "",
             f"Weights floor of one cloud step: {result['weights_floor_ms']} ms ({result['shard']} at 2 bytes a "
             f"weight over {result['bandwidth_gbs']:g} GB/s).", "", *table(head, cells)]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a bench spec speculative.json")
    add_paper_options(parser)
    parser.add_argument("--out", required=True, help="directory for projection.json and projection.md")
    parser.add_argument("--cloud-ms", default="0,1,3,10", help="assumed GPU cloud step costs, comma-separated")
    parser.add_argument("--shards", default="shards/smollm2", help="the prepared shards (for the weights floor)")
    parser.add_argument("--bandwidth-gbs", type=float, default=4800.0, help="the GPU's memory bandwidth, GB/s")
    args = parser.parse_args()
    if args.paper:
        paper_main(args)
        return
    run = json.loads(Path(args.run).read_text())
    shard = Path(args.shards) / "cloud"
    result = {"command": "python scripts/gpu_projection.py " + " ".join(sys.argv[1:]), "run": args.run,
              "run_command": run["command"], "shard": str(shard), "bandwidth_gbs": args.bandwidth_gbs,
              "weights_floor_ms": weights_floor_ms(shard, 2, args.bandwidth_gbs),
              "rows": rows(run, [float(c) for c in args.cloud_ms.split(",")])}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "projection.json").write_text(json.dumps(result, indent=2))
    (out / "projection.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
