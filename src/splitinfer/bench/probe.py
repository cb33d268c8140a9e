"""`splitinfer bench probe --server URL`: the round trip and bandwidth of the real path to a server, and what
they mean for each decoding mode, before committing to a provider.

Many small messages (decode-sized, both ways) give the round trip (median, p90); a few large ones each
way give the bandwidth (bytes over the time beyond one round trip). Probes go through the same
handshake, token and TLS as generation, and the server does no compute for them. Expected tok/s per
mode comes from a benchmark's fitted model (bench.json of `splitinfer bench`):
`1000 a / (RTT + f + bytes per step / bandwidth)`, where f was measured on the benchmark's hardware.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from ..errors import ConfigError
from ..local.auth import ClientAuth, client_auth_from_args
from ..local.middle import RemoteMiddle
from . import throughput

SMALL_BYTES = 1300  # about one SmolLM2 decode step each way; small next to any link's bandwidth
DEFAULT_BENCH = Path("notes/bench/bench.json")


def _stats(values: list[float]) -> dict:
    return {
        "median": round(statistics.median(values), 3),
        "p90": round(statistics.quantiles(values, n=10)[-1], 3) if len(values) > 1 else round(values[0], 3),
        "min": round(min(values), 3),
        "n": len(values),
    }


def measure(url: str, small: int = 50, large: int = 3, large_bytes: int = 1 << 20, auth: ClientAuth = ClientAuth()) -> dict:
    if small < 2 or large < 1 or large_bytes < 1024:
        raise ConfigError("probe needs --small >= 2, --large >= 1 and --large-kb >= 1.")
    middle = RemoteMiddle.prober(url, auth)  # a probe needs no shard
    try:
        middle.probe(SMALL_BYTES, SMALL_BYTES)  # connection and code paths warm
        rtts = [middle.probe(SMALL_BYTES, SMALL_BYTES) for _ in range(small)]
        rtt = statistics.median(rtts)
        up = [middle.probe(large_bytes, SMALL_BYTES) for _ in range(large)]
        down = [middle.probe(SMALL_BYTES, large_bytes) for _ in range(large)]
    finally:
        middle.close(end_session=False)

    def mbit(times: list[float]) -> float | None:
        extra = statistics.median(times) - rtt
        # a link too fast to tell from the round trip at this size reads as unmeasured, not infinite
        return round((large_bytes - SMALL_BYTES) * 8 / (extra * 1e3), 2) if extra > 0.05 * rtt and extra > 0.2 else None

    return {"url": url, "round_trip_ms": _stats(rtts), "large_bytes": large_bytes,
            "up_ms": _stats(up), "down_ms": _stats(down), "up_mbit": mbit(up), "down_mbit": mbit(down)}


def expected_rates(path: dict, bench: dict) -> list[dict]:
    """tok/s per mode on this path from a sweep's fitted model, with the transfer time of its bytes per step."""
    rtt = path["round_trip_ms"]["median"]
    out = []
    for mode, entry in bench["summary"]["model"].items():
        if not mode.startswith("split-") or not entry.get("fitted"):
            continue
        rows = [r for r in bench["summary"]["rows"] if r["mode"] == mode]
        per_step = statistics.median(r["bytes_per_step"] for r in rows)
        transfer = 0.0
        for bw in (path["up_mbit"], path["down_mbit"]):
            transfer += (per_step / 2) * 8 / (bw * 1e3) if bw else 0.0
        tps = throughput.Fit(entry["a"], entry["f_ms"] + transfer, entry["points"], 0.0).tokens_per_s(rtt)
        out.append({"mode": mode, "a": entry["a"], "f_ms": entry["f_ms"], "transfer_ms": round(transfer, 3),
                    "expected_tokens_per_s": round(tps, 2)})
    return out


def run(args) -> int:
    path = measure(args.server, args.small, args.large, args.large_kb * 1024, client_auth_from_args(args))
    bench_path = Path(args.bench) if args.bench else (DEFAULT_BENCH if DEFAULT_BENCH.exists() else None)
    result = {"path": path, "expected": [], "checks": []}
    if bench_path is not None:
        try:
            bench = json.loads(bench_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read {bench_path} ({exc}); give the bench.json written by `splitinfer bench`.") from exc
        result["bench"] = str(bench_path)
        result["expected"] = expected_rates(path, bench)
    if args.expect_rtt_ms is not None:
        result["checks"].append(throughput.check(f"probe round trip vs expected {args.expect_rtt_ms:g} ms",
                                                 path["round_trip_ms"]["median"], args.expect_rtt_ms, 0.10))
    if args.json:
        print(json.dumps(result))
    else:
        print(text(result))
    return 1 if any(not c["passed"] for c in result["checks"]) else 0


def text(result: dict) -> str:
    p = result["path"]
    bw = lambda v: f"{v:g} Mbit/s" if v else "too fast to measure at this size (use --large-kb)"  # noqa: E731
    rt = p["round_trip_ms"]
    lines = [
        f"path to {p['url']}",
        f"  round trip   median {rt['median']} ms, p90 {rt['p90']} ms, min {rt['min']} ms ({rt['n']} x {SMALL_BYTES} B each way)",
        f"  bandwidth    up {bw(p['up_mbit'])}, down {bw(p['down_mbit'])} ({p['up_ms']['n']} x {p['large_bytes']} B each way)",
    ]
    if result["expected"]:
        lines.append(f"expected decode rate on this path (model fitted in {result['bench']}; f holds for that hardware):")
        for e in result["expected"]:
            lines.append(f"  {e['mode']:<18} {e['expected_tokens_per_s']:7.2f} tok/s  (a={e['a']}, f={e['f_ms']} ms, "
                         f"transfer {e['transfer_ms']} ms/step)")
    else:
        lines.append("pass --bench DIR/bench.json (from `splitinfer bench sweep`) for the expected tok/s per mode.")
    for c in result["checks"]:
        lines.append(f"{'PASS' if c['passed'] else 'FAIL'}: {c['check']}: {c['measured']} ms ({c['relative_error']:.1%}, "
                     f"tolerance {c['tolerance']:.0%})")
    return "\n".join(lines)
