"""The threat-model table of docs/privacy.md and the README, written from audit.json files.

Who can see what, and how much of the text each recovers in the measured configurations: the best
attacker's top-1 recovery (with the frequency prior beside it) per threat, read from the audit's rows, so
the docs cannot drift from the data. The table goes between `<!-- threat-table:begin -->` and
`<!-- threat-table:end -->` in each file it updates. This module reads JSON and writes Markdown; it runs
no model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

BEGIN, END = "<!-- threat-table:begin -->", "<!-- threat-table:end -->"
# Shown where the best attacker reads 90% or more: the split gives no confidentiality there.
INSTEAD = "a confidential-computing GPU for the cloud half, or a model you do not run on someone else's machine"


@dataclass(frozen=True)
class Threat:
    who: str  # the party, in the reader's words
    sees: str  # what it has
    threat: str  # audit row key
    defence: str  # audit row key


THREATS = (
    Threat("anyone who reads logs, dumps or a tap behind TLS, without the cloud shard", "activations; public weights",
           "T0", "none"),
    Threat("the same reader, deployment in a secret rotation (`privatize --basis --key orthogonal`)",
           "activations in the secret basis; public weights; its own text (other documents); the sessions' traffic",
           "T3", "secret basis"),
    Threat("the same reader, deployment under a secret linear key (`privatize --basis`, the default)",
           "activations under the key; public weights; its own text (other documents); the sessions' traffic", "T3",
           "secret linear key"),
    Threat("the cloud host", "activations and the cloud layers (= public weights)", "T0", "none"),
    Threat("the cloud host, secret basis", "activations and this deployment's cloud shard", "T4", "secret basis"),
    Threat("the cloud host, linear key", "activations and this deployment's cloud shard (its norm factor)", "T4",
           "secret linear key"),
    Threat("the cloud host, private local weights (`privatize --text`), pushing its own text through them",
           "activations; 10^5 chosen-plaintext tokens", "T2", "private weights"),
    Threat("the host or a log reader holding known (text, activation) pairs, secret basis",
           "N pairs (largest N measured), or traffic of documents it knows, unpaired", "T5", "secret basis"),
    Threat("the same, linear key", "as above", "T5", "secret linear key"),
)


def _best(rows: list[dict], threat: str, defence: str, side: str, depth: int) -> dict | None:
    chosen = [r for r in rows if r["threat"] == threat and r["defence"] == defence and r["side"] == side
              and r["depth"] == depth]
    if threat in ("T2", "T5") and chosen:  # the learning curves: the largest N measured
        n = max(_n(r) for r in chosen)
        chosen = [r for r in chosen if _n(r) == n]
    return max(chosen, key=lambda r: r["top1"], default=None)


def _n(row: dict) -> int:
    return int(row.get("chosen_plaintext_tokens") or row.get("known_pairs") or 0)


def _cell(row: dict | None) -> str:
    if row is None:
        return "not measured"
    return f"**{100 * row['top1']:.1f}%** ({row['attacker']}; prior {100 * row['baseline_top1']:.1f}%)"


def threat_table(sources: list[tuple[str, dict]], depth: int = 2, short: bool = False) -> str:
    """sources: (label, audit.json dict) pairs; rows found in several come from the first one (so a later,
    larger run of some threats is named before the audit it supersedes them in).
    short: without the "has" and "data" columns (the README's version)."""
    lines = [
        f"| who | has | prompt tokens recovered (input side, k = {depth}) | generated tokens recovered "
        f"(output side, m = {depth}) | use instead | data |",
        "|---|---|---|---|---|---|",
        "| a network observer, TLS intact | ciphertext, sizes, timing | none (metadata only: lengths, timing, "
        "accepted-draft counts) | none | - | TLS; not an audit row |",
    ]
    for t in THREATS:
        cells, labels = [], []
        for side in ("input", "output"):
            hits = ((lab, _best(result["results"], t.threat, t.defence, side, depth)) for lab, result in sources)
            found = next(((lab, row) for lab, row in hits if row is not None), (None, None))
            cells.append(found[1])
            if found[0] and found[0] not in labels:
                labels.append(found[0])
        everything = max((r["top1"] for r in cells if r is not None), default=0) >= 0.9
        lines.append(f"| {t.who} | {t.sees} | {_cell(cells[0])} | {_cell(cells[1])} | "
                     f"{INSTEAD if everything else '-'} | {', '.join(labels) or '-'} ({t.threat}) |")
    if short:
        cells = [line.strip("|").split(" | ") for line in lines]
        lines = ["| " + " | ".join(c for i, c in enumerate(row) if i not in (1, 5)).strip() + " |" for row in cells]
        lines[1] = "|---|---|---|---|"
    metadata = [] if short else metadata_table(sources)
    if metadata:
        lines[2] = lines[2].replace("TLS; not an audit row", "TLS; T6 below")
    lines.append("")
    lines.append("Top-1 token recovery of the best measured attacker; prior = the frequency-prior baseline (guessing "
                 "the most common token). Generated by `splitinfer privacy table` from the audit files named in "
                 "the last column.")
    return "\n".join(lines + metadata)


T6_SIDES = ("accepted", "category", "document")


def metadata_table(sources: list[tuple[str, dict]]) -> list[str]:
    """T6's rows of their own: per padding setting, the best attacker's recovery from message sizes and times
    beside its chance, and the bytes a decode step costs. Empty when no audit has T6 rows."""
    label, rows = next(((lab, [r for r in res["results"] if r["threat"] == "T6"]) for lab, res in sources
                        if any(r["threat"] == "T6" for r in res["results"])), (None, []))
    if not rows:
        return []
    lines = ["", "A network observer with TLS intact (T6), from message sizes and times on real traffic:", "",
             "| who | padding | bytes per decode step | accepted count of each step | prompt category | which of "
             "N known documents | data |", "|---|---|---:|---|---|---|---|"]
    for defence in dict.fromkeys(r["defence"] for r in rows):
        mine = [r for r in rows if r["defence"] == defence]
        best = [max((r for r in mine if r["side"] == side), key=lambda r: r["top1"], default=None) for side in T6_SIDES]
        cells = [f"**{100 * r['top1']:.1f}%** ({r['attacker']}; chance {100 * r['baseline_top1']:.1f}%)"
                 if r is not None else "not measured" for r in best]
        padding = "none" if defence == "none" else _padding_options(mine[0])
        lines.append(f"| a network observer, TLS intact | {padding} | {mine[0]['bytes_per_decode_step']:.0f} | "
                     f"{' | '.join(cells)} | {label} (T6) |")
    return lines


def _padding_options(row: dict) -> str:
    """The client options that made a T6 row's padding, e.g. `--pad-rows 33` `--pad-steps 64`."""
    options = [("pad_rows", "--pad-rows"), ("pad_prompt_rows", "--pad-prompt-rows"), ("pad_steps", "--pad-steps"),
               ("pad_hold_ms", "--pad-hold-ms"), ("pad_think_ms", "--pad-think-ms")]
    return " ".join(f"`{flag} {row[key]}`" for key, flag in options if row.get(key))


def replace_marked(path: Path, text: str) -> None:
    content = path.read_text()
    if BEGIN not in content or END not in content:
        raise ConfigError(f"{path} has no {BEGIN} ... {END} markers; add them where the table should go.")
    head, rest = content.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")


def write_tables(audits: list[Path], targets: list[Path], depth: int = 2, short_targets: list[Path] = ()) -> str:
    sources = []
    for path in audits:
        if not path.is_file():
            raise ConfigError(f"{path} does not exist; pass audit.json files written by `splitinfer privacy audit`.")
        sources.append((str(path), json.loads(path.read_text())))
    text = threat_table(sources, depth)
    for target in targets:
        replace_marked(target, text)
    for target in short_targets:
        replace_marked(target, threat_table(sources, depth, short=True))
    return text
