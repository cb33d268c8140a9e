"""`bench spec`'s Markdown report, made from the report dict alone (spec_summary.py computes its numbers)."""

from __future__ import annotations

from ..decoding.controller import row_bucket
from ..local.session import AUTO_IN_FLIGHT
from ..tables import table


def results_table(report: dict) -> list[str]:
    """The headline table, one row per mode, every figure from this report's one run."""
    summary = report["summary"]
    header = ["mode", "added RTT ms", "tok/s, whole set", "x sequential, whole set (median prompt)", "x local-only, whole set",
              "emitted tokens/step, pooled (mean over prompts)", "bound tok/s", "RTT efficiency"]
    rows = []
    local = summary.get("local_only")
    anchor = (local or {}).get("transformers")
    if anchor:
        vs = round(anchor["tokens_per_s_whole_set"] / local["tokens_per_s_whole_set"], 3)
        rows.append(["plain transformers greedy (whole model, own cache, same core)", "-",
                     anchor["tokens_per_s_whole_set"], "-", f"{vs}x", "1.0", "-", "-"])
    if local:
        rows.append(["local-only (whole model, one process)", "-", local["tokens_per_s_whole_set"], "-", "1.0x", "1.0",
                     local["bound"]["tokens_per_s"], "-"])
    for r in summary["rows"]:
        vs_local = f"{r['vs_local_only_whole_set']}x" if r.get("vs_local_only_whole_set") else "-"
        rows.append([f"split, {r['strategy']}", f"{r['rtt_ms']:g}", r.get("tokens_per_s_whole_set", "-"),
                     f"{r['speedup_whole_set']}x ({r['speedup_vs_sequential_median']}x)", vs_local,
                     f"{r['mean_accepted_pooled']} ({r['mean_accepted_per_step']})",
                     r["bound"]["tokens_per_s"] if r.get("bound") else "-", r.get("rtt_efficiency") or "-"])
    return table(header, rows)


def _bound_table(summary: dict) -> list[str]:
    rows = []
    local = summary.get("local_only")
    if local:
        b = local["bound"]
        rows.append(["local-only", "-", b["a"], b["local_ms"], b["cloud_ms"], b["drafting_ms"], b["tokens_per_s"],
                     local["tokens_per_s_whole_set"]])
    for r in summary["rows"]:
        if r.get("bound"):
            b = r["bound"]
            rows.append([r["strategy"], f"{r['rtt_ms']:g}", b["a"], b["local_ms"], b["cloud_ms"], b["drafting_ms"],
                         b["tokens_per_s"], r.get("tokens_per_s_whole_set", "-")])
    return table(["mode", "added RTT ms", "a", "local ms", "cloud ms", "drafting ms", "bound tok/s",
                  "measured tok/s, whole set"], rows)


def _strategy_table(summary: dict) -> list[str]:
    header = ["strategy", "added RTT ms", "tok/s (median)", "speed-up vs sequential (median, min)", "whole set vs sequential",
              "runs below 0.95x", "accepted/step (mean over prompts)", "pooled", "max", "rows/step (median)",
              "bytes/step (median)", "vs prompt lookup"]
    return table(header, [[r["strategy"], f"{r['rtt_ms']:g}", r["tokens_per_s_median"],
                           f"{r['speedup_vs_sequential_median']}x, {r['speedup_vs_sequential_min']}x",
                           f"{r['speedup_whole_set']}x", r["prompt_runs_below_0_95x"], r["mean_accepted_per_step"],
                           r["mean_accepted_pooled"], r["max_accepted_per_step"], r["median_rows_per_step"],
                           r["median_bytes_per_step"], f"{r['vs_prompt_lookup']}x"] for r in summary["rows"]])


def markdown(report: dict) -> str:
    summary = report["summary"]
    categories = sorted({c for row in summary["rows"] for c in row["per_category_accepted"]})
    lines = [
        f"# Speculative decoding benchmark: {report['model']}",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Setup: {report['setup']}. {len(report['prompts'])} prompts, {report['max_new_tokens']} new tokens, "
        f"{report['repeats']} repetitions after one warm-up per configuration. torch {report['torch']}.",
        "",
        *_padding_lines(report),
        *results_table(report),
        "",
        "Bound: 1000 a / (added RTT + local + cloud + drafting), a the pooled emitted tokens per step and the "
        "rest mean ms per decode step of the same runs:",
        "",
        *_bound_table(summary),
        "",
        *_strategy_table(summary),
    ]
    lines += _head_lines(summary, categories)
    lines += _in_flight_lines(summary)
    lines += _step_cost_lines(summary)
    lines += _category_tables(summary, categories)
    lines += _divergence_lines(report)
    lines += _anchor_lines(summary)
    return "\n".join(lines) + "\n"


def _padding_lines(report: dict) -> list[str]:
    if all(str(setting) == "0" for setting in report.get("pad_rows") or ()):  # names of PadSetting; 0: none
        return []
    prompts = f" also pad prompt messages to {report['pad_prompt_rows']} rows;" if report.get("pad_prompt_rows") else ""
    return [f"Padded configurations ('+padN': steps and replies to multiples of N rows;{prompts} '+sS': each reply's "
            "exchanges padded to a multiple of S with cover exchanges; '+hH': every reply held H ms after its step "
            "arrived; '+tT': every step sent T ms after the previous reply); their tok/s counts the padding's time.", ""]


def _anchor_lines(summary: dict) -> list[str]:
    anchor = (summary.get("local_only") or {}).get("transformers")
    if not anchor:
        return []
    return ["", f"Local-only against plain transformers greedy decoding of the same model on the same core and thread "
            f"(interleaved prompt by prompt): {anchor['local_only_vs_transformers']}x its rate over the whole set; "
            f"token-identical {anchor['identical_to_local_only']}. Every \"x local-only\" above is against "
            "splitinfer's own local-only path."]


def _head_lines(summary: dict, categories: list[str]) -> list[str]:
    rows = [r for r in summary["rows"] if r.get("draft_head")]
    if not rows:
        return []
    lines = ["", "The learned head: the share of decode steps it drafted on; per drafting step, the block rows and "
             "accepted tokens that only it proposed and its drafting ms; accepted tokens only it proposed per decode "
             "step, over all prompts and by category:", ""]
    header = ["strategy", "added RTT ms", "drafted on", "head-only rows", "head-only accepted", "drafting ms", "per step",
              *categories]
    body = [[r["strategy"], f"{r['rtt_ms']:g}", h["drafting_share"], h["rows_per_drafting_step"],
             h["tokens_per_drafting_step"], h["ms_per_drafting_step"], h["tokens_per_step"],
             *(h["tokens_per_step_by_category"].get(c, "") for c in categories)]
            for r in rows for h in [r["draft_head"]]]
    return lines + table(header, body)


def _in_flight_lines(summary: dict) -> list[str]:
    rows = summary.get("in_flight") or []
    if not rows:
        return []
    lines = ["", "Blocks in flight: measured tok/s (whole set) against the bound 1000 a / ((1 - p) L + p max(t, L / D)); "
             "a emitted tokens per resolved block, p the share of resolved blocks that went ahead and held, D their "
             "mean depth, L and t (ms per block: decode wall time, busiest stage) measured on the same strategy's "
             "D = 1 runs; sent ahead and hold: blocks sent ahead and the share whose assumption held; score / held: "
             "the mean chance the controller gave each assumption against how often it held:", "",
             ]
    header = ["strategy", "added RTT ms", "D", "mean D", "a", "p", "sent ahead", "hold", "score / held", "L ms", "t ms",
              "bound tok/s", "measured tok/s", "x D = 1, whole set", "x D = 1, lowest prompt"]
    body = []
    for r in rows:
        calibration = f"{r['score']} / {r['held']}" if r.get("score") is not None else "-"
        depth = "auto" if r["in_flight"] == AUTO_IN_FLIGHT else r["in_flight"]
        body.append([r["strategy"], f"{r['rtt_ms']:g}", depth, r.get("depth", "-"), r["a"], r["p"], r.get("sent_ahead", "-"),
                     r.get("hold") if r.get("hold") is not None else "-", calibration, r["L_ms"], r["t_ms"],
                     r["bound_tokens_per_s"], r["tokens_per_s_whole_set"], f"{r['vs_one_in_flight']}x",
                     f"{r.get('vs_one_in_flight_min', '-')}x"])
    return lines + table(header, body)


def _step_cost_lines(summary: dict) -> list[str]:
    curve = summary.get("step_cost") or {}
    buckets = sorted({b for per_rtt in curve.values() for b in per_rtt})
    if not buckets:
        return []
    lowest = {b: next((q + 1 for q in range(b - 1, 0, -1) if row_bucket(q) != b), 1) for b in buckets}
    names = [str(b) if lowest[b] == b else f"{lowest[b]}-{b}" for b in buckets]
    lines = ["", "Decode step ms by block rows (median over every step of every strategy in this run; round trip, "
             "local compute and serialisation, not drafting; steps in brackets): the curve the controller prices "
             "blocks with:", ""]
    body = [[rtt, *(f"{per_rtt[b]['median_ms']} ({per_rtt[b]['steps']})" if b in per_rtt else "" for b in buckets)]
            for rtt, per_rtt in curve.items()]
    return lines + table(["added RTT ms", *names], body, "|---:|" + "---:|" * len(buckets))


def _category_tables(summary: dict, categories: list[str]) -> list[str]:
    header = ["strategy", "added RTT ms", *categories]

    def row(name: str, rtt: str, values: dict) -> list:
        return [name, rtt, *(values.get(c, "") for c in categories)]

    accepted = [row("prompt lookup (local)", "-", summary["prompt_lookup_per_category"])]
    accepted += [row(r["strategy"], f"{r['rtt_ms']:g}", r["per_category_accepted"]) for r in summary["rows"]]
    pooled = [row(r["strategy"], f"{r['rtt_ms']:g}", r.get("per_category_pooled", {})) for r in summary["rows"]]
    lines = [
        "",
        f"Accepted tokens per step by category, mean over prompts (repetition 0); transformers prompt lookup (local, "
        f"`prompt_lookup_num_tokens=10`) for reference, mean {summary['prompt_lookup_mean_accepted']}:",
        "",
        *table(header, accepted),
        "", "Emitted tokens per step by category, pooled over every step of every repetition:", "",
        *table(header, pooled),
    ]
    lines += ["", "Distribution of accepted tokens per step (count of steps):", ""]
    for r in summary["rows"]:
        lines.append(f"- {r['strategy']} @ {r['rtt_ms']:g} ms: {r['accepted_histogram']}")
    return lines


def _divergence_lines(report: dict) -> list[str]:
    divergences = report["divergences"]
    lines = [""]
    local = report["summary"].get("local_only")
    if local:
        same = ", ".join(f"{v} at {k} ms" for k, v in local["identical_to_split_sequential"].items())
        lines += [f"Split sequential generations token-identical to local-only {report.get('dtype', 'float32')}: {same}.", ""]
    if divergences:
        lines.append("Generations whose tokens differ from sequential decoding at the same round trip "
                     f"({report.get('wire_dtype', 'float16')} wire), "
                     f"with the local {report.get('dtype', 'float32')} model's top-1 minus top-2 logit at the first "
                     "different token:")
        lines.append("")
        for d in divergences:
            lines.append(f"- {d['strategy']} @ {d['rtt_ms']:g} ms, {d['prompt_id']} (rep {d['repeat']}): token "
                         f"{d['first_different_token']}, margin {d['local_float32_margin']}")
    else:
        lines.append("Every generation was token-identical to sequential decoding at the same round trip.")
    return lines
