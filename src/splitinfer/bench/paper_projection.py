"""`splitinfer bench project --paper`: the paper's configuration (mistral-7b-v0.1, 2 + 2 local layers; issue 49)
projected from measured parts at --paper-rtts, every input labelled measured, scaled or bound.

The model: tok/s = 1000 a / (RTT + local + cloud + drafting), the bound `bench spec` writes for each strategy,
with each term replaced by the 7B figure: a, rows a step and drafting ms measured on the shipped model's MT-Bench
run (drafting for a 7B head would cost more); local: the 7B trusted half's step at those rows and the run's mean
context, measured on this CPU by `bench trusted-half` (`--trusted`; without it, its bytes bound at this CPU's
bandwidth as a `bench step` run measured it, `--cpu-step`), and the same scaled to a laptop by bandwidth
(--laptop-gbs, assumed); cloud: the GPU check's measured cloud step (`--device-step`; without it, the cloud
layers' bfloat16 bytes over --bandwidth-gbs, a bound). The paper's own figures (its measured 8.3 sequential and
8.8 lookahead tok/s at ~78-80 ms, its projected ones at 20 and 150 ms, its 26.2 ms RTX 3090 and 15.9 ms A100
steps) stand beside. Nothing here is a measurement of its own.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from ..tables import table
from .harness import command_line, write
from .plan import load_config, plan

CONFIG = "mistral-7b-v0.1"
# arXiv:2602.16760 via /work/shared/reference/split-inference-over-wan.md: its measured tok/s at ~78-80 ms,
# its projection table (sections 6.3, 8.4) at the RTTs it gives, and its per-step breakdown at 78 ms.
PAPER_MEASURED = {"sequential": (78.0, 8.3), "lookahead": (80.0, 8.8)}
PAPER_PROJECTED = {"sequential": {20.0: 15.9, 80.0: 8.1, 150.0: 5.2}, "lookahead": {20.0: 18.6, 80.0: 8.8, 150.0: 5.4}}
PAPER_LOCAL_MS, PAPER_CLOUD_MS, PAPER_SERIALIZATION_MS = 26.2, 15.9, 1.0  # RTX 3090, A100, at 78 ms


def interpolate(points: dict[float, float], x: float) -> float:
    """Piecewise linear through {x: y}, held flat outside the measured range."""
    xs = sorted(points)
    if x <= xs[0]:
        return points[xs[0]]
    if x >= xs[-1]:
        return points[xs[-1]]
    hi = next(i for i, v in enumerate(xs) if v >= x)
    x0, x1 = xs[hi - 1], xs[hi]
    return points[x0] + (points[x1] - points[x0]) * (x - x0) / (x1 - x0)


def grid_value(rows: list[dict], field: str, q: float, context: float) -> float:
    """A step's ms at q rows and `context` cached tokens, linear in rows then in context."""
    by_context: dict[float, dict[float, float]] = {}
    for r in rows:
        by_context.setdefault(r["context"], {})[r["rows"]] = r[field]
    return interpolate({c: interpolate(points, q) for c, points in by_context.items()}, context)


def spec_inputs(run: dict) -> dict:
    """a, drafting ms and rows a step of each strategy, and the mean context, from a bench spec run."""
    out = {}
    for row in run["summary"]["rows"]:
        steps = [x for r in run["runs"] if r["strategy"] == row["strategy"] for x in r["rows"]]
        out[row["strategy"]] = {"a": row["bound"]["a"], "drafting_ms": row["bound"]["drafting_ms"],
                                "rows": round(statistics.mean(steps), 2)}
    context = statistics.mean(len(r["prompt_token_ids"]) + len(r["token_ids"]) / 2 for r in run["runs"])
    return {"strategies": out, "context": round(context, 1)}


def trusted_variants(args, sizing: dict, context: float) -> list[dict]:
    """The trusted half's step as functions of rows: measured per format (its fastest thread count), the
    fastest one scaled to a laptop by bandwidth; without a measurement, the bytes bound per format."""
    if args.trusted:
        data = json.loads(Path(args.trusted).read_text())
        data["rows"] = [r for r in data["rows"] if r.get("side", "local") == "local"]  # cloud rows: a CPU's cloud
        variants = []
        for fmt in sorted({r["format"] for r in data["rows"]}):
            threads = min({r["threads"] for r in data["rows"] if r["format"] == fmt},
                          key=lambda t: sum(r["splitinfer_ms"] for r in data["rows"] if (r["format"], r["threads"]) == (fmt, t)))
            rows = [r for r in data["rows"] if (r["format"], r["threads"]) == (fmt, threads)]
            variants.append({"name": f"this CPU, {fmt}, {threads} thread(s)", "label": "measured",
                             "ms": lambda q, rows=rows: grid_value(rows, "splitinfer_ms", q, context),
                             "gbps": rows[0]["bandwidth_gbps"]})
        best = min(variants, key=lambda v: v["ms"](1))
        variants.append({"name": f"a laptop ({best['name'].removeprefix('this CPU, ')}, scaled)",
                         "label": f"scaled: x {best['gbps']:g} / {args.laptop_gbs:g} GB/s (assumed)",
                         "ms": lambda q, b=best: b["ms"](q) * b["gbps"] / args.laptop_gbs, "gbps": args.laptop_gbs})
        return variants
    gbps = json.loads(Path(args.cpu_step).read_text())["bandwidth_gbps"]
    variants = []
    for fmt, width in (("float32", 4), ("bfloat16", 2)):
        streamed = sizing["local_streamed_params"] * width + sizing["local_kv_per_token_per_byte"] * width * context
        variants.append({"name": f"this CPU, {fmt}", "label": f"bound: bytes / {gbps:g} GB/s measured",
                         "ms": lambda q, b=streamed, g=gbps: b / g / 1e6, "gbps": gbps})
    streamed = sizing["local_streamed_params"] * 2 + sizing["local_kv_per_token_per_byte"] * 2 * context
    variants.append({"name": "a laptop, bfloat16", "label": f"bound: bytes / {args.laptop_gbs:g} GB/s (assumed)",
                     "ms": lambda q, b=streamed: b / args.laptop_gbs / 1e6, "gbps": args.laptop_gbs})
    return variants


def cloud_step(args, sizing: dict, context: float) -> dict:
    if args.device_step:
        data = json.loads(Path(args.device_step).read_text())
        field = "graph_ms" if all(r["graph_ms"] is not None for r in data["rows"]) else "eager_ms"
        return {"label": f"measured ({data.get('device_name') or data['device']}, {data['dtype']}, "
                         f"{field.removesuffix('_ms')})", "ms": lambda q: grid_value(data["rows"], field, q, context)}
    bytes_ = sizing["cloud_bf16_bytes"] + sizing["cloud_kv_bf16_per_token"] * context
    source = " (H200 datasheet)" if args.bandwidth_gbs == 4800.0 else " (--bandwidth-gbs)"
    return {"label": f"bound: bfloat16 bytes / {args.bandwidth_gbs:g} GB/s{source}",
            "ms": lambda q: bytes_ / args.bandwidth_gbs / 1e6}


def sizing_of() -> dict:
    _, cfg = load_config(CONFIG)
    r32, r16 = plan(cfg, 2, 2, "float32"), plan(cfg, 2, 2, "bfloat16")
    embed = r32["architecture"]["vocab"] * r32["architecture"]["hidden"]
    return {"local_streamed_params": r32["local_params"] - embed,  # the lookup reads one row of the embedding
            "local_kv_per_token_per_byte": r32["local_kv_bytes_per_token"] // 4,
            "cloud_bf16_bytes": r16["cloud_weight_bytes"], "cloud_kv_bf16_per_token": r16["cloud_kv_bytes_per_token"]}


def project_paper(args, run: dict) -> dict:
    rtts = [float(x) for x in args.paper_rtts.split(",")]
    sizing = sizing_of()
    spec = spec_inputs(run)
    context = spec["context"]
    cloud = cloud_step(args, sizing, context)
    rows = []
    for strategy, s in spec["strategies"].items():
        for variant in trusted_variants(args, sizing, context):
            local, cloud_ms = variant["ms"](s["rows"]), cloud["ms"](s["rows"])
            step = local + cloud_ms + s["drafting_ms"]
            rows.append({"strategy": strategy, "trusted": variant["name"], "a": s["a"], "rows": s["rows"],
                         "local_ms": round(local, 2), "local_label": variant["label"], "cloud_ms": round(cloud_ms, 3),
                         "cloud_label": cloud["label"], "drafting_ms": s["drafting_ms"],
                         "tokens_per_s": {f"{r:g}": round(1000 * s["a"] / (r + step), 2) for r in rtts},
                         "rtt_efficiency": {f"{r:g}": round(r / (r + step), 3) for r in rtts}})
        paper_step = PAPER_LOCAL_MS + PAPER_CLOUD_MS + PAPER_SERIALIZATION_MS
        rows.append({"strategy": strategy, "trusted": "the paper's RTX 3090, its A100 cloud", "a": s["a"], "rows": s["rows"],
                     "local_ms": PAPER_LOCAL_MS, "local_label": "paper, measured", "cloud_ms": PAPER_CLOUD_MS,
                     "cloud_label": "paper, measured (+1.0 ms serialization)", "drafting_ms": s["drafting_ms"],
                     "tokens_per_s": {f"{r:g}": round(1000 * s["a"] / (r + paper_step + s["drafting_ms"]), 2) for r in rtts},
                     "rtt_efficiency": {f"{r:g}": round(r / (r + paper_step + s["drafting_ms"]), 3) for r in rtts}})
    return {"config": CONFIG, "split": "2 + 2",
            "spec_run": args.run, "spec_command": run["command"], "mean_context": context, "rtts_ms": rtts,
            "trusted": args.trusted, "device_step": args.device_step, "rows": rows,
            "paper": {"measured": PAPER_MEASURED, "projected": PAPER_PROJECTED}}


def paper_body(result: dict) -> list[str]:
    rtts = [f"{r:g}" for r in result["rtts_ms"]]
    lines = ["tok/s = 1000 a / (RTT + local + cloud + drafting). a, rows a step and drafting ms: measured on the "
             f"shipped SmolLM2's MT-Bench run (`{result['spec_command']}`; drafting for a 7B head would cost more); "
             f"local and cloud at that run's rows a step and mean context ({result['mean_context']} tokens). "
             "Each input says whether it was measured, scaled or is a bound (a bound is a floor on the step, so its "
             "tok/s is a ceiling).", ""]
    efficiency = min(rtts, key=lambda k: abs(float(k) - 80))  # the paper's round trip, or the nearest run
    lines[0] += (f" RTT efficiency: the round trip's share of the step at {efficiency} ms, RTT / (RTT + local + cloud + "
                 "drafting).")
    head = ["strategy", "trusted machine", "a", "rows", "local ms", "local is", "cloud ms", "cloud is", "drafting ms",
            f"RTT efficiency at {efficiency} ms", *[f"{r} ms" for r in rtts]]
    body = [[r["strategy"], r["trusted"], r["a"], r["rows"], r["local_ms"], r["local_label"], r["cloud_ms"], r["cloud_label"],
             r["drafting_ms"], r["rtt_efficiency"][efficiency], *(r["tokens_per_s"][k] for k in rtts)]
            for r in result["rows"]]
    paper = result["paper"]
    for name in ("sequential", "lookahead"):
        rtt, tps = paper["measured"][name]
        body.append([f"paper: {name}", f"measured {tps} tok/s at ~{rtt:g} ms; projected where it gave one", "", "", "", "", "",
                     "", "", "", *(paper["projected"][name].get(float(k), "-") for k in rtts)])
    return lines + table(head, body)


def paper_plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rtts = result["rtts_ms"]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for r in result["rows"]:
        ax.plot(rtts, [r["tokens_per_s"][f"{x:g}"] for x in rtts], marker="o",
                linestyle="-" if r["strategy"] == "tree" else "--", label=f"{r['strategy']}: {r['trusted']}")
    for name, marker in (("sequential", "s"), ("lookahead", "^")):
        rtt, tps = result["paper"]["measured"][name]
        ax.scatter([rtt], [tps], marker=marker, color="black", zorder=5, label=f"paper, {name}, measured")
    ax.set_xlabel("round trip, ms")
    ax.set_ylabel("tok/s (projected)")
    ax.set_title(f"{result['config']} ({result['split']}): projected from measured parts")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=6.5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_paper(args, log=print) -> dict:
    """`bench project --paper`: OUT/projection.json, .md and .png."""
    run = json.loads(Path(args.run).read_text())
    result = project_paper(args, run)
    out = Path(args.out)
    write(out, "projection", result, paper_body(result), command=command_line(args), log=log,
          title=f"{result['config']} ({result['split']}) projected from measured parts")
    paper_plot(result, out / "projection.png")
    return result
