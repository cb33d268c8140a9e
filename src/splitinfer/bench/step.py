"""`splitinfer bench step`: what one decode step's compute costs, beside plain transformers and the bound.

For each side of the split (the cloud's middle layers; the local head and tail layers with the final
norm and the LM head) and each block of q rows at each context length, three figures on the same core
and threads:

- **splitinfer**: the side's own code as a step runs it (`LayerStack` on a `KVCache`, the explicit mask,
  the CPU products of model/rows.py, the attention of model/attention.py, the LM head over every row);
- **transformers**: the same layers in plain transformers (a model of that many layers holding the same
  weights, its own `DynamicCache`, masks, `F.linear` and sdpa attention, logits for every row on the
  local side);
- **bounds** (bench/machine.py, measured on the same thread): the bytes the step must stream (the side's
  weights once, plus the cached keys and values it reads) over the memory bandwidth, and the weight
  products' flops over the product peak (integer products over the int8 dot-product peak, where the
  project's kernels multiply with that instruction); beside them the rate the profiled products reached.

Both run on real activations of the benchmark prompts (token embeddings for the local side, the local
head's output for the cloud's). Configurations run in a shuffled order every repetition after a warm-up;
medians are reported. One
profiled pass per configuration splits the splitinfer step into weight products, attention, other
operators (norms, rotary, activation, residual adds, cache writes) and the rest (Python and dispatch,
wall time minus operator time). `--e2e-prompts N` adds whole generations: the local-only path (sequential,
the whole model in one process) against transformers greedy decoding with its own cache, ms per token,
each pair back to back on one prompt; the ratio is the median of the pairs' ratios.

`--max-ratio R` is the release guard: the command exits 1 when, for any block of at most `--guard-rows`
rows, splitinfer's step costs more than R times transformers' (and `--e2e-max-ratio` for generations).
The guard runs inside the benchmark, never as a timed test.
"""

from __future__ import annotations

import functools
import json
import platform
import random
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .. import __version__
from ..launch import pin_self
from .. import kernels
from ..model.layers import kernel_table
from ..tables import table
from .anchors import e2e
from .harness import rounds
from .side import Side, build_sides
from .machine import PEAK_SIZE, amx_gops, bandwidth_gbps, cpu_flags, int8_dot_gops, kernels_line, product_gflops

GROUPS = ("products", "attention", "other ops", "python and dispatch")
PRODUCT_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise", "aten::linear", "aten::matmul",
               "aten::_int_mm", "aten::_weight_int4pack_mm_for_cpu",
               "quantized::linear_with_input_q_dq_qweight_dq_output_fp32",  # the integer formats' (model/formats.py)
               "splitinfer::w4a8_mm", "splitinfer::w8a8_mm", "splitinfer::w8a8_linear")  # kernels/
ATTENTION_OPS = ("splitinfer::rows_attention",)  # beside every op whose name has scaled_dot_product


@dataclass(frozen=True)
class StepBenchConfig:
    rows: tuple[int, ...] = (1, 2, 4, 8, 16, 32)  # block rows q
    contexts: tuple[int, ...] = (64, 2048)  # committed rows in the cache before the block
    threads: int = 1  # torch threads (bench spec runs each side on one)
    cpu: int = 0  # core to pin to (-1: no pinning)
    dtype: str | None = None  # compute dtype of both sides (None: the shards')
    repeats: int = 7  # timed repetitions of every configuration, after one warm-up round
    max_ratio: float = 0.0  # guard: splitinfer / transformers per step, blocks of <= guard_rows; 0 = off
    guard_rows: int = 8
    e2e_prompts: int = 0  # whole generations: local-only vs transformers greedy on this many prompts (0 = off)
    e2e_tokens: int = 64
    e2e_max_ratio: float = 0.0  # guard on the generations' ms per token; 0 = off
    sides: tuple[str, ...] = ("cloud", "local")  # the sides timed; a shard directory may hold only these


# -- measuring -----------------------------------------------------------------------------------------


def time_configs(sides: list[Side], rows: tuple[int, ...], repeats: int) -> dict[tuple, list[float]]:
    """{(side index, q, 'ours'|'anchor'): [ms, ...]}, every configuration once per round, shuffled; the first
    round warms up (packs weights, allocates buffers) and is dropped."""
    inputs = {(i, q): s.block(q) for i, s in enumerate(sides) for q in rows}
    calls = {(i, q, impl): functools.partial(getattr(sides[i], impl), q, inputs[(i, q)])
             for i in range(len(sides)) for q in rows for impl in ("ours", "anchor")}
    return {key: [t * 1e3 for t in times] for key, times in rounds(calls, repeats, shuffle=random.Random(0)).items()}


def breakdown(side: Side, q: int) -> dict[str, float]:
    """ms of one splitinfer step by group (module docstring), from one profiled pass after one plain pass."""
    from torch.profiler import ProfilerActivity, profile

    hidden = side.block(q)
    side.ours(q, hidden)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        side.ours(q, hidden)
        wall = (time.perf_counter() - t0) * 1e3
    groups = dict.fromkeys(GROUPS, 0.0)
    for event in prof.key_averages():
        ms = event.self_cpu_time_total / 1e3
        if event.key in PRODUCT_OPS:
            groups["products"] += ms
        elif "scaled_dot_product" in event.key or event.key in ATTENTION_OPS:
            groups["attention"] += ms
        elif event.key.startswith(("aten::", "mkldnn::", "splitinfer::")):
            groups["other ops"] += ms
    ops = sum(groups.values())
    # The profiler's own cost lands in the wall time; shares are reported against the operators' sum plus
    # the remainder, scaled to the unprofiled median by the caller.
    groups["python and dispatch"] = max(wall - ops, 0.0)
    total = sum(groups.values()) or 1.0
    return {k: v / total for k, v in groups.items()}


def run(shards: Path, config: StepBenchConfig, log=print) -> dict:
    pin_self(config.cpu if config.cpu >= 0 else None, config.threads)
    gbps = bandwidth_gbps()
    log(f"memory bandwidth, {config.threads} thread(s): {gbps:.1f} GB/s")
    sides = build_sides(shards, config.contexts, config.rows, config.dtype, config.sides)
    peak = product_gflops(sides[0].dtype)
    log(f"product peak: {peak:.1f} GFLOP/s ({str(sides[0].dtype).removeprefix('torch.')})")
    int8_peak, amx_peak = int8_dot_gops(), amx_gops()
    log(f"int8 dot-product peak: {int8_peak:.1f} GOP/s" if int8_peak else "int8 dot-product peak: not measured")
    log(f"AMX int8 peak: {amx_peak:.1f} GOP/s" if amx_peak else "AMX int8 peak: AMX does not run here")
    times = time_configs(sides, config.rows, config.repeats)
    rows = []
    for i, side in enumerate(sides):
        for q in config.rows:
            ours = statistics.median(times[(i, q, "ours")])
            anchor = statistics.median(times[(i, q, "anchor")])
            shares = breakdown(side, q)
            rows.append({
                "side": side.name, "context": side.context, "rows": q, "layers": sum(len(s.layers) for s in side.stacks),
                "splitinfer_ms": round(ours, 2), "transformers_ms": round(anchor, 2), "ratio": round(ours / anchor, 3),
                "bound_ms": round(side.streamed_bytes() / gbps / 1e6, 2),
                "compute_bound_ms": float(f"{side.compute_bound_ms(q, peak, int8_peak, amx_peak):.4g}"),
                "breakdown_ms": {k: round(v * ours, 2) for k, v in shares.items()},
            })
            row, products_ms = rows[-1], rows[-1]["breakdown_ms"]["products"]
            row["weights_bound_ms"] = round(side.streamed_bytes(cached=False) / gbps / 1e6, 2)
            below = row["weights_bound_ms"] + row["breakdown_ms"]["attention"]  # attention reads the cached keys
            row["x_weights_attention"] = round(row["splitinfer_ms"] / below, 2) if below else None  # the JSON's fields
            row["products_gflops"] = round(side.product_flops(q) / products_ms / 1e6, 1) if products_ms else None
            log(f"{side.name:<5} ctx {side.context:>5} q {q:>2}: splitinfer {ours:7.1f} ms  transformers {anchor:7.1f} ms  "
                f"x{ours / anchor:.2f}  bound {rows[-1]['bound_ms']} ms")
    report = {
        "command": "splitinfer " + shlex.join(sys.argv[1:]) if sys.argv[0].endswith("splitinfer") else shlex.join(sys.argv),
        "version": __version__, "torch": torch.__version__, "machine": platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_flags": cpu_flags(),
        "kernels": kernels.report(), "modules": kernel_table(*(s for side in sides for s in side.stacks)),
        "config": asdict(config),
        "dtype": str(sides[0].dtype).removeprefix("torch."), "bandwidth_gbps": round(gbps, 2),
        "product_peak_gflops": round(peak, 1), "int8_dot_peak_gops": int8_peak and round(int8_peak, 1),
        "amx_peak_gops": amx_peak and round(amx_peak, 1), "rows": rows,
        "synthetic": synthetic_source(shards),  # random weights in a config's shape (model/synthetic.py), or None
        "weights": shard_manifest(shards).get("weights"),  # each part's weight format (model/formats.py)
    }
    if config.e2e_prompts:
        report["e2e"] = e2e(shards, config, log)
    report["guard"] = guard(report, config)
    return report


def shard_manifest(shards: Path) -> dict:
    """The local shard's manifest, else the cloud's (a directory may hold one side)."""
    for side in ("local", "cloud"):
        path = shards / side / "manifest.json"
        if path.is_file():
            return json.loads(path.read_text())
    return {}


def synthetic_source(shards: Path) -> dict | None:
    """What a synthetic shard was made from (config name, seed), None for a real model's shards."""
    manifest = shard_manifest(shards)
    return manifest.get("synthetic_source") if manifest.get("synthetic") else None


def guard(report: dict, config: StepBenchConfig) -> dict:
    """The release guard's verdict: every checked ratio and whether it held."""
    failures = []
    if config.max_ratio:
        failures += [f"{r['side']} ctx {r['context']} q {r['rows']}: x{r['ratio']}" for r in report["rows"]
                     if r["rows"] <= config.guard_rows and r["ratio"] > config.max_ratio]
    e2e_ = report.get("e2e")
    if config.e2e_max_ratio and e2e_ and e2e_["ratio"] > config.e2e_max_ratio:
        failures.append(f"generation ms per token: x{e2e_['ratio']}")
    return {"max_ratio": config.max_ratio, "guard_rows": config.guard_rows, "e2e_max_ratio": config.e2e_max_ratio,
            "failures": failures, "passed": not failures}


def int8_line(report: dict) -> str:
    peak, amx = report.get("int8_dot_peak_gops"), report.get("amx_peak_gops")
    line = f", int8 dot-product peak {peak} GOP/s (kernels/probe.cpp's int8_dot_peak)" if peak else ""
    return line + (f" and AMX int8 peak {amx} GOP/s (w8a8_amx.cpp's amx_peak)" if amx else "")


def compute_peaks(report: dict) -> str:
    if report.get("amx_peak_gops"):
        return ("the peak of the instruction each runs on (int8 products on AMX tiles: the AMX peak; int4: the "
                "int8 dot products' peak; float ones: the float peak)")
    if report.get("int8_dot_peak_gops"):
        return "their peak (integer products: the int8 dot products' peak; float ones: the float peak)"
    return "that float peak (integer products, as the int4 kernel's, can run past it)"


def threads_line(config: dict) -> str:
    pinned = f"pinned to core {config['cpu']}" if config["cpu"] >= 0 else "not pinned"
    return f"{config['threads']} thread(s), {pinned}"


def markdown(report: dict) -> str:
    lines = [f"# One decode step: splitinfer against plain transformers ({report['dtype']})", "",
             f"`{report['command']}`", "",
             *([f"Synthetic weights: seeded random values in the shape of {report['synthetic']['config']} (seed "
                f"{report['synthetic']['seed']}); a step's cost depends on the shapes, not the values.", ""]
               if report.get("synthetic") else []),
             f"torch {report['torch']} ({report['cpu_capability']}; {' '.join(report['cpu_flags'])}; kernels "
             f"{kernels_line(report)}), {threads_line(report['config'])}; measured on those threads: memory bandwidth "
             f"{report['bandwidth_gbps']} GB/s, product peak "
             f"{report['product_peak_gflops']} GFLOP/s (a {PEAK_SIZE}-square product){int8_line(report)}. "
             f"Medians of {report['config']['repeats']} shuffled repetitions after a warm-up, ms per step. Memory bound: "
             "the side's weights plus the cached keys/values it reads, over that bandwidth; compute bound: the weight "
             f"products' flops over {compute_peaks(report)}; products GFLOP/s: those flops over the profiled products' "
             "time; x (weights + attention): the step over its weights' bytes over that bandwidth plus its attention.", ""]
    header = ["side", "context", "rows", "splitinfer", "transformers", "ratio", "memory bound", "compute bound",
              "x (weights + attention)", *GROUPS, "products GFLOP/s"]
    body = [[r["side"], r["context"], r["rows"], r["splitinfer_ms"], r["transformers_ms"], f"{r['ratio']}x", r["bound_ms"],
             r["compute_bound_ms"], f"{r.get('x_weights_attention') or '-'}x", *(r["breakdown_ms"][g] for g in GROUPS),
             r["products_gflops"]] for r in report["rows"]]
    lines += table(header, body, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|") + [""]
    e2e_ = report.get("e2e")
    if e2e_:
        lines += [f"Whole generations, {e2e_['tokens']} tokens, prompts {', '.join(e2e_['prompts'])}: local-only "
                  f"sequential {e2e_['splitinfer_ms_per_token']} ms a token, transformers greedy "
                  f"{e2e_['transformers_ms_per_token']} (medians); paired ratio {e2e_['ratio']}x (median over "
                  f"{len(e2e_['runs'])} back-to-back pairs); token-identical {e2e_['identical']}.", ""]
    g = report["guard"]
    verdict = "passed" if g["passed"] else "FAILED: " + "; ".join(g["failures"])
    lines.append(f"Guard (step ratio <= {g['max_ratio'] or 'off'} for <= {g['guard_rows']} rows, generation ratio <= "
                 f"{g['e2e_max_ratio'] or 'off'}): {verdict}.")
    return "\n".join(lines) + "\n"


def plot(report: dict, out: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    keys = sorted({(r["side"], r["context"]) for r in report["rows"]})
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.6), squeeze=False)
    for ax, (side, context) in zip(axes[0], keys):
        rs = [r for r in report["rows"] if (r["side"], r["context"]) == (side, context)]
        qs = [r["rows"] for r in rs]
        for field, label in (("splitinfer_ms", "splitinfer"), ("transformers_ms", "transformers"), ("bound_ms", "bound")):
            ax.plot(qs, [r[field] for r in rs], marker="o", label=label, linestyle=":" if field == "bound_ms" else "-")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{side}, context {context}")
        ax.set_xlabel("block rows")
        ax.set_ylabel("ms per step")
        ax.set_ylim(bottom=0)
    axes[0][0].legend()
    fig.tight_layout()
    path = out / "step.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def run_step_bench(shards: Path, out: Path, config: StepBenchConfig, log=print) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    report = run(shards, config, log)
    (out / "step.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(report, out)
    (out / "step.md").write_text(markdown(report))
    log(f"wrote {out / 'step.json'}, step.md, step.png")
    return report
