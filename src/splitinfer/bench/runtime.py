"""Runtime benchmark: local-only vs split sequential at several added round trips, with the breakdown.

Fair on a 2-core machine: the client (and the local-only model) runs in this process pinned to core 0
with one torch thread; the cloud server runs in a child process pinned to core 1 with one thread, and
the WAN emulator shares core 1 (it only forwards bytes while the server waits). Modes are interleaved
within each repetition, so drift on a shared machine hits them alike; one warm-up generation per mode
is discarded; figures are medians over prompts x repetitions.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import sys
import time
from contextlib import ExitStack
from importlib import resources
from pathlib import Path

import torch

from .. import __version__
from ..launch import cloud_server, wan_proxy
from ..local.client import SplitClient
from ..local.session import ClientConfig


def load_prompts(path: str | None, per_category: int) -> list[dict]:
    if path:
        text = Path(path).read_text()
    else:
        text = resources.files("splitinfer.data").joinpath("prompts.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    chosen: dict[str, list[dict]] = {}
    for row in rows:
        bucket = chosen.setdefault(row["category"], [])
        if len(bucket) < per_category:
            bucket.append(row)
    return [r for bucket in chosen.values() for r in bucket]


def _pin_self(cpu: int) -> None:
    if hasattr(os, "sched_setaffinity") and cpu < (os.cpu_count() or 1):
        os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)


def _median(values):
    return round(statistics.median(values), 3) if values else None


def codec_microbench(hidden_size: int, repeats: int = 2000) -> dict:
    """Warm client-side cost of encoding one decode step and decoding its reply (median, microseconds)."""
    from ..masks import BlockStructure
    from ..wire.messages import Limits, Result, Step, decode_server_message

    hidden = torch.randn(1, hidden_size)
    limits = Limits(hidden_size)
    reply = Result(7, hidden, 1.0, 1.0, 100, "float16").encode()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        Step(7, (0,), (100,), BlockStructure.chain(), hidden, "float16").encode()
        decode_server_message(reply, limits)
        times.append((time.perf_counter() - t0) * 1e6)
    return {"encode_step_and_decode_result_us": round(statistics.median(times), 2), "repeats": repeats}


def run_runtime_bench(args) -> dict:
    shards = Path(args.shards)
    rtts = [float(x) for x in str(args.rtt_ms).split(",") if x.strip()]
    prompts = load_prompts(args.prompts, args.per_category)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _pin_self(0)

    local_only = SplitClient.local_only(shards)
    runs: list[dict] = []
    with ExitStack() as stack:
        url, _ = stack.enter_context(cloud_server(shards / "cloud", cpu=1, threads=1))
        clients = {"local-only": local_only}
        for rtt in rtts:
            target = url if rtt == 0 else stack.enter_context(wan_proxy(url, rtt, cpu=1))
            clients[f"split-sequential@{rtt:g}"] = SplitClient.connect(shards / "local", target, ClientConfig())
        for mode, client in clients.items():  # warm-up: first calls allocate and fill caches
            client.generate(prompts[0]["prompt"], max_new_tokens=8)
        for rep in range(args.repeats):
            for mode, client in clients.items():
                for p in prompts:
                    result = client.generate(p["prompt"], max_new_tokens=args.max_new_tokens, chat=p.get("chat", True))
                    runs.append(
                        {
                            "mode": mode,
                            "rtt_ms": 0.0 if mode == "local-only" else float(mode.split("@")[1]),
                            "repeat": rep,
                            "prompt_id": p["id"],
                            "category": p["category"],
                            "token_ids": result.token_ids,
                            "stats": result.stats,
                            "steps": result.steps,
                        }
                    )
                    print(f"[{rep}] {mode:<24} {p['id']:<18} {result.stats['tokens_per_s']:7.2f} tok/s", file=sys.stderr)

    summary = summarize_runs(runs)
    report = {
        "command": "splitinfer bench " + " ".join(shlex.quote(a) for a in sys.argv[2:]),
        "splitinfer": __version__,
        "torch": torch.__version__,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "processor": platform.processor()},
        "setup": "client and local-only model: this process, core 0, 1 thread; cloud server: child process, "
        "core 1, 1 thread; WAN emulator: child process on core 1; float16 wire; greedy",
        "model": json.loads((shards / "local" / "manifest.json").read_text())["model_id"],
        "prompts": [p["id"] for p in prompts],
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "summary": summary,
        "codec_warm": codec_microbench(local_only.local.config.hidden_size),
        "runs": [{k: v for k, v in r.items() if k != "steps"} for r in runs],
    }
    (out / "runtime.json").write_text(json.dumps(report, indent=1))
    (out / "runtime.md").write_text(markdown(report))
    print(markdown(report))
    return report


def summarize_runs(runs: list[dict]) -> list[dict]:
    reference = {(r["prompt_id"], r["repeat"]): r["token_ids"] for r in runs if r["mode"] == "local-only"}
    rows = []
    for mode in dict.fromkeys(r["mode"] for r in runs):
        mine = [r for r in runs if r["mode"] == mode]
        steps = [s for r in mine for s in r["steps"] if s["kind"] == "decode"]
        step_total = [s["round_trip_ms"] + s["local_ms"] + s["serialize_ms"] for s in steps]
        rows.append(
            {
                "mode": mode,
                "rtt_ms": mine[0]["rtt_ms"],
                "generations": len(mine),
                "tokens_per_s": _median([r["stats"]["tokens_per_s"] for r in mine]),
                "step_ms": _median(step_total),
                "network_ms": _median([max(s["round_trip_ms"] - s["server_ms"], 0.0) for s in steps]),
                "cloud_compute_ms": _median([s["cloud_compute_ms"] for s in steps]),
                "server_other_ms": _median([s["server_ms"] - s["cloud_compute_ms"] for s in steps]),
                "local_compute_ms": _median([s["local_ms"] for s in steps]),
                "serialize_ms": _median([s["serialize_ms"] for s in steps]),
                "bytes_per_step": _median([s["bytes_up"] + s["bytes_down"] for s in steps]),
                "identical_to_local_only": sum(
                    r["token_ids"] == reference.get((r["prompt_id"], r["repeat"])) for r in mine
                ),
            }
        )
    return rows


def markdown(report: dict) -> str:
    lines = [
        f"# Runtime benchmark: {report['model']}",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Setup: {report['setup']}. Prompts: {', '.join(report['prompts'])}; {report['max_new_tokens']} new tokens; "
        f"{report['repeats']} repetitions after one warm-up per mode; medians. torch {report['torch']}, "
        f"{report['machine']['cpus']} CPUs.",
        "",
        "| mode | added RTT ms | tok/s | step ms | network ms | cloud compute ms | server other ms | local compute ms "
        "| serialize ms | bytes/step | identical to local-only |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["summary"]:
        lines.append(
            f"| {r['mode']} | {r['rtt_ms']:g} | {r['tokens_per_s']} | {r['step_ms']} | {r['network_ms']} | "
            f"{r['cloud_compute_ms']} | {r['server_other_ms']} | {r['local_compute_ms']} | {r['serialize_ms']} | "
            f"{r['bytes_per_step']} | {r['identical_to_local_only']}/{r['generations']} |"
        )
    lines += [
        "",
        "Step = client round trip + local compute + client serialization. Network = round trip minus the server's "
        "handling time. For local-only, 'cloud compute' is the middle layers run in-process. Absolute times hold "
        "for this machine only; compare the ratios measured side by side in one run.",
        "",
        f"Codec, warm (encode one decode step + decode its reply, median of {report['codec_warm']['repeats']}): "
        f"{report['codec_warm']['encode_step_and_decode_result_us']} us. The in-situ 'serialize' column is larger "
        "because that code runs first after the process has slept through the round trip (cold caches and clocks).",
    ]
    return "\n".join(lines) + "\n"
