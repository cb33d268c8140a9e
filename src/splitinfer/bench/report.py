"""The sweep's Markdown report and plots, made from bench.json alone (`splitinfer bench sweep --report-only`),
and the results section of notes/benchmarks.md (`--docs`), which is that same report between two markers.

Plots need matplotlib (`pip install 'splitinfer[bench]'`); without it the report says so and the JSON and
Markdown are still written.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ConfigError
from ..tables import table
from .summary import BREAKDOWN

PLOTS = ("tokens_per_s_vs_rtt.png", "breakdown.png", "prefill.png")


def _fit_note(e: dict) -> str:
    if e.get("fitted"):
        return str(e.get("max_residual_ms"))
    return f"not fitted: {e['error']}" if e.get("error") else "not fitted (RTT 0 only)"


def _or_dash(value) -> str:
    return "-" if value is None else str(value)


def markdown(report: dict, plot_dir: str = "", level: int = 1) -> str:
    """The report; `plot_dir` prefixes image links, `level` is the top heading's level (2 inside a document)."""
    s, cfg = report["summary"], report["config"]
    h = "#" * level
    lines = [
        f"{h} Benchmark sweep: {report['model']}",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Setup: {report['setup']}. Prompts: {', '.join(report['prompts'])}; up to {cfg['max_new_tokens']} new tokens; "
        f"{cfg['repeats']} repetition(s) after one warm-up per configuration; medians over prompts x repetitions. "
        f"torch {report['torch']}, {report['machine']['cpus']} CPUs, took {report['elapsed_s']:.0f} s.",
        "",
        "Absolute times hold for this hardware only; the ratios between modes measured side by side in one "
        "run are the comparable figures.",
        "",
        f"{h}# Checks",
        "",
    ]
    for c in s["checks"]:
        lines.append(f"- {'PASS' if c['passed'] else 'FAIL'}: {c['check']}: {c['measured']} vs {c['expected']} "
                     f"({c['relative_error']:.1%}, tolerance {c['tolerance']:.0%})")
    lines += ["", f"{h}# tok/s, acceptance and the per-step breakdown (ms, mean per decode step, median over generations)", ""]
    lines += table(
        ["mode", "added RTT ms", "tok/s", "accepted/step", "bytes/step", "step ms", "network", "cloud compute",
         "server other", "local compute", "serialize", "between steps", "efficiency", "$/M tokens", "identical to local-only"],
        [[r["mode"], f"{r['rtt_ms']:g}", r["tokens_per_s"], r["accepted_per_step"], r["bytes_per_step"], r["step_ms"],
          *(r[k] for k in BREAKDOWN), r["efficiency"], r["usd_per_million_tokens"],
          f"{r['identical_to_local_only']}/{r['generations']}"] for r in s["rows"]],
    )
    lines += [
        "",
        "Step = client round trip + local compute + client serialization; network = round trip minus the server's "
        "handling time; between steps = decode wall time per step not inside a step (drafting, bookkeeping). "
        "For local-only the middle layers run in-process and appear as cloud compute; for local-only-pld "
        "(transformers' prompt lookup) the whole model call is local compute. Efficiency = tok/s over "
        "1000 * accepted / (added RTT + local + cloud compute). $/M tokens: one GPU at "
        f"${s['gpu_price_per_hour']:.2f}/h (an assumed price, `--gpu-price`) serving this single stream.",
        "",
        f"{h}# Throughput model tok/s = 1000 a / (RTT + f)",
        "",
    ]
    lines += table(
        ["mode", "fitted a", "measured a", "fitted f ms", "f ms at measured a", "measured f ms (step - RTT)",
         "incl. between steps", "measured f ms by RTT", "max residual ms/token"],
        [[m, _or_dash(e.get("a")), e["measured_a"], _or_dash(e.get("f_ms")), _or_dash(e.get("f_ms_at_measured_a")),
          e["measured_f_ms"], e["measured_f_with_between_steps_ms"],
          ", ".join(f"{k}: {v}" for k, v in e.get("measured_f_by_rtt", {}).items()) or "-", _fit_note(e)]
         for m, e in s["model"].items()],
    )
    lines += ["", "Fitted: least squares of ms per token against RTT, a and f free. f at measured a: the same model "
              "with a fixed to the measured acceptance. Measured f: mean step time from the telemetry minus the added "
              "RTT, median over RTTs (by RTT in the next column); 'incl. between steps' adds the time between steps."]
    if s["projection"]:
        modes = [k for k in s["projection"][0] if k != "rtt_ms"]
        lines += ["", "Projection outside the sweep (tok/s from the fitted a and f):", ""]
        lines += table(["RTT ms", *modes], [[f"{p['rtt_ms']:g}", *(p[m] for m in modes)] for p in s["projection"]])
    if s["break_even"]:
        lines += ["", "Break-even acceptance a* = (RTT + f_spec) / (RTT + f_seq) against split sequential:", ""]
        lines += table(["mode", "RTT ms", "a*", "measured a", "pays"],
                        [[b["mode"], f"{b['rtt_ms']:g}", b["break_even_a"], b["measured_a"] if b["measured_a"] is not None else "-",
                          {True: "yes", False: "no", None: "-"}[b["pays"]]] for b in s["break_even"]])
    lines += ["", "Probe (decode-sized messages on the idle path before the runs):", ""]
    lines += table(["added RTT ms", "median ms", "p90 ms"], [[k, v["median_ms"], v["p90_ms"]] for k, v in s["probe"].items()])
    prefill = report.get("prefill")
    if prefill:
        lines += ["", f"{h}# Prefill at {prefill['bandwidth_mbit']:g} Mbit/s per direction, +{prefill['rtt_ms']:g} ms RTT",
                  "", "wire = the prefill's exact messages (Step chunks of "
                  f"{prefill['chunk_rows']} rows up, every row's hidden state back) carried as probes, no compute; "
                  "real = an actual split prefill, compute included.", ""]
        lines += table(
            ["tokens", "kind", "chunks", "MB up", "MB down", "measured ms", "sequential floor ms", "link floor ms", "x link floor"],
            [[p["tokens"], p["kind"], p["chunks"], round(p["bytes_up"] / 1e6, 2), round(p["bytes_down"] / 1e6, 2),
              p["total_ms"], p["sequential_floor_ms"], p["link_floor_ms"], p["vs_link_floor"]] for p in prefill["results"]],
        )
        first = next((p for p in prefill["results"] if p["kind"] == "wire" and p["chunks"] > 1), None)
        if first:
            lines += ["", f"Trace of the {first['tokens']}-token wire prefill (ms from the first send; first chunks):", ""]
            lines += table(["chunk", "rows", "bytes up", "bytes down", "start", "end"],
                            [[i, c["rows"], c["bytes_up"], c["bytes_down"], c["start_ms"], c["end_ms"]]
                             for i, c in enumerate(first["trace"][:8])])
        lines += ["", "Floors: sequential = sum over chunks of (RTT + (up + down) * 8 / bandwidth); link = "
                  "max(total up, total down) * 8 / bandwidth + RTT (perfect pipelining)."]
    plots = report.get("plots") or []
    lines += ["", f"{h}# Plots", ""]
    lines += [f"![{p}]({plot_dir}{p})" for p in plots] if plots else [f"No plots: {report.get('plots_error', 'not made')}."]
    return "\n".join(lines) + "\n"


def _save(fig, out: Path, name: str) -> str:
    """Lay out, write OUT/name and free one finished figure; returns name."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(out / name, dpi=120)
    plt.close(fig)
    return name


def _label(ax, xlabel: str | None, ylabel: str, title: str, legend: str, grid: bool = True) -> None:
    """Axis labels (no x label: None), the title, a small legend at `legend` and, with `grid`, a light grid."""
    if xlabel is not None:
        ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7, loc=legend)
    if grid:
        ax.grid(alpha=0.3)


def plot(report: dict, out: Path) -> list[str]:
    """tok/s vs RTT per mode with the fitted curves, stacked breakdown bars, prefill traces."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = report["summary"]
    made = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    rtt_max = max((r["rtt_ms"] for r in s["rows"]), default=0) or 100.0
    grid = [rtt_max * 1.1 * i / 100 for i in range(101)]
    for i, (mode, entry) in enumerate(s["model"].items()):
        mine = sorted((r for r in s["rows"] if r["mode"] == mode), key=lambda r: r["rtt_ms"])
        color = f"C{i}"
        if len(mine) == 1:
            ax.axhline(mine[0]["tokens_per_s"], color=color, linestyle=":", label=f"{mode} (no RTT)")
            continue
        ax.plot([r["rtt_ms"] for r in mine], [r["tokens_per_s"] for r in mine], "o", color=color, label=mode)
        if entry.get("fitted"):
            curve = [(g, 1000 * entry["a"] / (g + entry["f_ms"])) for g in grid if g + entry["f_ms"] > 0]
            ax.plot([c[0] for c in curve], [c[1] for c in curve], "-", color=color, alpha=0.6,
                    label=f"  fit a={entry['a']:.2f}, f={entry['f_ms']:.0f} ms")
    _label(ax, "added round trip (ms)", "tokens/s (median)", f"{report['model']}: tok/s vs round trip", "upper right")
    made.append(_save(fig, out, PLOTS[0]))

    fig, ax = plt.subplots(figsize=(max(7, 0.45 * len(s["rows"])), 4.5))
    labels = [f"{r['mode'].replace('split-', '').replace('local-only', 'local')}\n{r['rtt_ms']:g}" for r in s["rows"]]
    bottom = [0.0] * len(s["rows"])
    for j, key in enumerate(BREAKDOWN):
        values = [r[key] for r in s["rows"]]
        ax.bar(range(len(values)), values, bottom=bottom, label=key.removesuffix("_ms").replace("_", " "), color=f"C{j}")
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(range(len(labels)), labels, fontsize=6)
    _label(ax, None, "ms per decode step (mean)", "Where a step's time goes (mode, added RTT ms)", "upper left",
           grid=False)
    made.append(_save(fig, out, PLOTS[1]))

    prefill = report.get("prefill")
    if prefill:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for i, p in enumerate(x for x in prefill["results"] if x["kind"] == "wire"):
            ends, sent = [0.0], [0.0]
            for c in p["trace"]:
                ends.append(c["end_ms"])
                sent.append(sent[-1] + c["bytes_up"] / 1e6)
            ax.step(ends, sent, where="post", color=f"C{i}", label=f"{p['tokens']} tokens ({p['chunks']} chunks)")
            ax.axvline(p["link_floor_ms"], color=f"C{i}", linestyle=":", alpha=0.7)
        _label(ax, "ms since the first chunk was sent (dotted: link floor)", "MB of hidden states answered",
               f"Prefill over {prefill['bandwidth_mbit']:g} Mbit/s, +{prefill['rtt_ms']:g} ms: one step per chunk",
               "lower right")
        made.append(_save(fig, out, PLOTS[2]))
    return made


DOCS_BEGIN = "<!-- splitinfer bench: begin (generated by `splitinfer bench sweep --docs`; do not edit by hand) -->"
DOCS_END = "<!-- splitinfer bench: end -->"


def update_docs(doc: Path, report: dict, out: Path) -> None:
    """Replace the text between the markers in `doc` with the report (image links relative to `doc`)."""
    text = doc.read_text()
    begin, end = text.find(DOCS_BEGIN), text.find(DOCS_END)
    if begin < 0 or end < begin:
        raise ConfigError(f"{doc} has no results section; add the two lines {DOCS_BEGIN!r} and {DOCS_END!r} where it goes.")
    rel = os.path.relpath(out, doc.parent)
    body = markdown(report, plot_dir="" if rel == "." else rel + "/", level=3)
    doc.write_text(text[: begin + len(DOCS_BEGIN)] + "\n\n" + body + "\n" + text[end:])
