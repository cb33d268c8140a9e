"""`bench spec --shards A,B,...`: the same speculative benchmark on several prepared shards (weight formats,
`prepare --weights`) in one command, and a table that compares them.

Every shards directory gets the whole of `bench spec` (its own server, its own local-only and transformers
anchors, its report in OUT/<format>/), interleaved prompt by prompt: each prompt runs on every format before
the next one starts (bench/speculative.py's run_interleaved), so a machine whose speed drifts during the run
moves every format alike. The first directory is the reference (float32, say). The comparison pairs every
generation with the reference's generation of the same strategy, prompt, round trip and repetition: tok/s
ratios are medians of those pairs, their spread reported beside them.
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
from pathlib import Path

from ..tables import table


def shards_label(shards: Path) -> str:
    """A shards directory's weight formats as `prepare --weights` would take them (or its dtype)."""
    from ..model.formats import WeightFormats

    manifest = json.loads((shards / "local" / "manifest.json").read_text())
    weights = manifest.get("weights")
    return WeightFormats(**weights).spec() if weights else manifest["dtype"]


def run_spec_formats(args, run_many) -> dict:
    """`run_many([args, ...])` (bench/speculative.py's run_interleaved) over every shards directory; the
    comparison report."""
    dirs = [Path(s.strip()) for s in str(args.shards).split(",") if s.strip()]
    out = Path(args.out)
    each = {}
    for shards in dirs:
        label = shards_label(shards)
        if label in each:
            label = f"{label} ({shards.name})"
        one = copy.copy(args)
        one.shards, one.out, one.readme = str(shards), str(out / label.replace(",", "+").replace("=", "-")), None
        print(f"bench spec: {label} ({shards})", file=sys.stderr)
        each[label] = one
    reports = dict(zip(each, run_many(list(each.values()))))
    report = {"command": "splitinfer bench spec " + " ".join(sys.argv[3:]), "reference": next(iter(reports)),
              "formats": {k: {"out": str(out / k.replace(",", "+").replace("=", "-")), "summary": compare_row(v)}
                          for k, v in reports.items()},
              "paired": paired(reports)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "formats.json").write_text(json.dumps(report, indent=1))
    (out / "formats.md").write_text(markdown(report))
    print(markdown(report))
    return report


def compare_row(report: dict) -> dict:
    """What one format's run says in the comparison: local-only, its anchor, each strategy's row."""
    summary = report["summary"]
    local = summary.get("local_only") or {}
    rows = {f"{r['strategy']}@{r['rtt_ms']:g}": {
        "tokens_per_s_whole_set": r.get("tokens_per_s_whole_set"), "emitted_per_step": r["mean_accepted_pooled"],
        "rtt_efficiency": r.get("rtt_efficiency"), "speedup_vs_own_sequential": r["speedup_whole_set"]}
        for r in summary["rows"]}
    return {"local_only_tokens_per_s": local.get("tokens_per_s_whole_set"),
            "transformers_tokens_per_s": (local.get("transformers") or {}).get("tokens_per_s_whole_set"),
            "divergences": len(report["divergences"]), "rows": rows}


def paired(reports: dict[str, dict]) -> dict:
    """{format: {strategy@rtt: median, min and max of tok/s over the reference's same generation}}."""
    reference = next(iter(reports.values()))
    key = lambda r: (r["strategy"], r["rtt_ms"], r["prompt_id"], r["repeat"])  # noqa: E731
    ref = {key(r): r["tokens_per_s"] for r in reference["runs"]}
    out = {}
    for label, report in reports.items():
        ratios: dict[str, list[float]] = {}
        for r in report["runs"]:
            if key(r) in ref:
                ratios.setdefault(f"{r['strategy']}@{r['rtt_ms']:g}", []).append(r["tokens_per_s"] / ref[key(r)])
        out[label] = {k: {"median": round(statistics.median(v), 3), "min": round(min(v), 3), "max": round(max(v), 3)}
                      for k, v in ratios.items()}
    return out


def markdown(report: dict) -> str:
    ref = report["reference"]
    rows = []
    for label, entry in report["formats"].items():
        s = entry["summary"]
        rows.append([label, "local-only", "-", s["local_only_tokens_per_s"], "-", "-", "-", "-"])
        for name, r in s["rows"].items():
            pair = report["paired"][label].get(name, {})
            spread = f"{pair['median']}x ({pair['min']}-{pair['max']})" if pair else "-"
            rows.append([label, name.split("@")[0], name.split("@")[1], r["tokens_per_s_whole_set"], spread,
                         r["emitted_per_step"], r["rtt_efficiency"], s["divergences"]])
    lines = [f"Command: `{report['command']}`", "",
             f"Each format ran the whole benchmark (reports in its own folder), every prompt on each format before "
             f"the next prompt; x {ref} pairs every generation with the reference's same strategy, prompt, round trip "
             "and repetition (median, min-max).",
             "", *table(["weights", "mode", "added RTT ms", "tok/s, whole set", f"x {ref}, same mode (pairs)",
                         "emitted tokens/step, pooled", "RTT efficiency", "outputs not equal to sequential"], rows)]
    return "\n".join(lines) + "\n"
