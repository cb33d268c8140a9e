"""Turn audit.json into DIR/audit.md and two plots (recovery vs depth; privacy vs utility).

Every rate is printed with its bootstrap interval, the frequency-prior baseline and the ceiling beside it.
This module reads the result dict only; it runs no model.
"""

from __future__ import annotations

from pathlib import Path

from ..tables import left_table
from .metadata import metadata_section


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _ci(ci) -> str:
    return f"[{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]"


def _p(p: float) -> str:
    return f"{p:.2g}" if p >= 1e-4 else "<1e-4"


def _results(rows: list[dict]) -> list[str]:
    header = ["side", "depth", "threat", "attacker", "defence", "top-1 % [95% CI]", "top-5 %", "baseline top-1 % [CI]",
              "baseline top-5 %", "ceiling %", "exact chunks %", "canary top-1 %", "tokens / docs"]
    return left_table(header, [[r["side"], r["depth"], r["threat"], r["attacker"], r["defence"],
                           f"{_pct(r['top1'])} {_ci(r['top1_ci'])}", _pct(r["top5"]),
                           f"{_pct(r['baseline_top1'])} {_ci(r['baseline_top1_ci'])}", _pct(r["baseline_top5"]),
                           _pct(r["ceiling"]), _pct(r["exact_sequence"]), _pct(r["canary_top1"]),
                           f"{r['n_tokens']} / {r['n_documents']}"] for r in rows])


KEYED = ("T3", "T4", "T5")


def _keyed_section(result: dict) -> list[str]:
    """T3-T5: the secret basis and the linear key against an observer, the host, and known plaintext."""
    rows = [r for r in result["results"] if r["threat"] in KEYED]
    if not rows:
        return []
    lines = ["## Secret residual basis and linear key (T3 observer without the cloud shard, T4 host, T5 known "
             "plaintext)", ""]
    for name, extra in (("secret basis", "secret_basis"), ("secret linear key", "secret_linear_key")):
        info = result.get(extra)
        if not info:
            continue
        t4 = info.get("t4") or {}
        lines.append(
            f"- {name} ({info['basis'].get('method', '?')}): sessions start with the chat template's "
            f"{info.get('template_tokens', '?')} opening tokens; rows are scored on the text after them. T4 weight "
            f"matching (A5): {t4.get('seconds', '?')} s, key error {t4.get('rotation_error', '?')}, permutation "
            f"recovered {_pct(t4.get('permutation_recovered'))}%. Moment alignment (A8) key error: "
            f"{info.get('alignment_error')}. A9: {info.get('a9')}.")
    return [*lines, "", *_results(rows), ""]


def _section(title: str, rows: list[dict]) -> list[str]:
    """A heading and its rows' table; nothing where the audit ran no such rows (`--quick` has no T0)."""
    return [f"## {title}", "", *_results(rows), ""] if rows else []


def _depth_identification(ident: dict | None) -> list[str]:
    if not ident:
        return []
    lines = ["", "## Can the cloud tell the split depth? (split-point randomisation)", "",
             "A classifier trained on the attacker's own text at each depth; per row, and by majority vote over "
             "each test chunk's rows (a session).", ""]
    body = []
    for block in (ident, ident.get("split_range")):
        if not block:
            continue
        for name in ("row statistics", "whole vector"):
            m = block[name]
            session = _pct(m["session_accuracy"]) if "session_accuracy" in m else "-"
            body.append([block["depths"], _pct(block["chance"]), name, _pct(m["row_accuracy"]), m["n_rows"], session,
                         m.get("n_sessions", "-")])
    return lines + left_table(["depths", "chance %", "features", "row accuracy %", "rows", "session accuracy %", "sessions"], body)


def markdown(result: dict) -> str:
    rows = result["results"]
    corpus = result["corpus"]
    lines = [
        "# Privacy audit",
        "",
        f"Model: `{result['model']}`. Wall time {result.get('wall_seconds', '?')} s.",
        f"Corpus: {corpus['sources']} source documents read; train {corpus['train']}, test {corpus['test']} "
        "(split by source document).",
        f"Targets: input side = {result['targets']['input']}; output side = {result['targets']['output']}.",
        "Baseline = frequency prior from the attacker's training targets (its top-1 is the majority token). "
        "Ceiling = 100% for attackers that rank the whole vocabulary (A1, A4), else the share of test tokens "
        "whose type occurs in the training targets. Intervals: bootstrap over documents.",
        "",
        *_section("T0: local layers are the public weights",
                  [r for r in rows if r["threat"] == "T0" and r["defence"] == "none"]),
        *_section("Defences (noise on the sent activations; private local weights under T1 and T2)",
                  [r for r in rows if not (r["threat"] == "T0" and r["defence"] == "none")
                   and r["threat"] not in (*KEYED, "T6")]),
        *_keyed_section(result),
        *metadata_section(result),
        "## Utility and throughput cost of the defences",
        "",
        *left_table(["defence", "side", "depth", "perplexity (original)", "greedy agreement %", "added local ms / token", "tokens"],
               [[d["defence"], d["side"], d["depth"],
                 f"{d['utility']['perplexity']:.2f} ({d['utility']['reference_perplexity']:.2f})",
                 _pct(d["utility"]["greedy_agreement"]), d.get("added_ms_per_token", 0), d["utility"]["n_tokens"]]
                for d in result.get("defences", [])]),
    ]
    curve = [r for r in rows if r["threat"] == "T2"]
    if curve:
        own = result.get("chosen_plaintext", {})
        lines += ["", "## T2 learning curve: chosen-plaintext tokens N vs recovery (private weights)", "",
                  f"The attacker's own text: {own.get('documents', '?')} documents that are not in the audit's "
                  f"train or test split; {own.get('input_tokens', '?')} tokens through the private head, "
                  f"{own.get('output_tokens', '?')} through the whole model (output side, capped).", ""]
        curve = sorted(curve, key=lambda r: (r["side"], r["attacker"].split(" ")[0], r["chosen_plaintext_tokens"]))
        lines += left_table(["side", "attacker", "N", "top-1 % [95% CI]", "baseline top-1 %", "ceiling %", "train s (capped)"],
                       [[r["side"], r["attacker"].split(" ")[0], r["chosen_plaintext_tokens"],
                         f"{_pct(r['top1'])} {_ci(r['top1_ci'])}", _pct(r["baseline_top1"]), _pct(r["ceiling"]),
                         f"{r['train_seconds']}{' (capped)' if r['capped'] else ''}"] for r in curve])
    lines += ["", "Split depth: same function, so no utility cost; local compute per decoded token:", ""]
    lines += left_table(["side", "local layers", "local ms / token (median decode step)"],
                   [[c["side"], c["depth"], c["local_ms_per_token"]] for c in result.get("depth_costs", [])])
    lines += _depth_identification(result.get("depth_identification"))
    lines += ["", "## Paired tests (exact McNemar on the same tokens)", "",
              "n01 = a wrong and b right; n10 = a right and b wrong.", ""]
    lines += left_table(["comparison", "a", "b", "n01", "n10", "p", "tokens"],
                   [[t["comparison"], t["a"], t["b"], t["n01"], t["n10"], _p(t["p_value"]), t["n_tokens"]]
                    for t in result["paired_tests"]])
    lines += ["", "Plots: `recovery_vs_depth.png`, `privacy_vs_utility.png`.", ""]
    return "\n".join(lines)


def plots(result: dict, out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []  # plots are optional; the JSON and Markdown carry every number
    rows = [r for r in result["results"] if r["threat"] == "T0" and r["defence"] == "none"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, side in zip(axes, ("input", "output")):
        side_rows = [r for r in rows if r["side"] == side]
        for attacker in sorted({r["attacker"] for r in side_rows}):
            pts = sorted((r["depth"], r["top1"], r["top1_ci"]) for r in side_rows if r["attacker"] == attacker)
            xs = [p[0] for p in pts]
            ax.errorbar(xs, [p[1] for p in pts], yerr=[[p[1] - p[2][0] for p in pts], [p[2][1] - p[1] for p in pts]],
                        marker="o", capsize=3, label=attacker)
        base = sorted((r["depth"], r["baseline_top1"]) for r in side_rows if r["attacker"] == "A1")
        ax.plot([b[0] for b in base], [b[1] for b in base], "k--", label="frequency prior")
        ax.set_title(f"{side} side (T0, public local weights)")
        ax.set_xlabel("local layers on this side (k or m)")
        ax.set_ylim(0, 1.02)
    axes[0].set_ylabel("top-1 token recovery")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "recovery_vs_depth.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for d in result.get("defences", []):
        side = "input" if d["side"] in ("input", "both") else d["side"]
        hits = [r["top1"] for r in result["results"] if r["side"] == side and r["depth"] == d["depth"]
                and r["defence"] == d["defence"]]
        if hits:
            ax.scatter(d["utility"]["greedy_agreement"], max(hits))
            ax.annotate(d["defence"], (d["utility"]["greedy_agreement"], max(hits)), fontsize=8)
    ax.set_xlabel("greedy agreement with the original model")
    ax.set_ylabel("best attacker top-1 (input side)")
    ax.set_xlim(0, 1.05)
    ax.set_ylim(0, 1.05)
    fig.tight_layout()
    fig.savefig(out / "privacy_vs_utility.png", dpi=110)
    plt.close(fig)
    return ["recovery_vs_depth.png", "privacy_vs_utility.png"]


def write_report(result: dict, out: Path) -> None:
    (out / "audit.md").write_text(markdown(result))
    plots(result, out)
