"""T6's audit rows (privacy/metadata.py) carry the audit's fields, and the threat table gives them rows of their
own; scored here on synthetic traffic (the traffic itself is recorded by the audit on the shipped model)."""

from __future__ import annotations

import json

from splitinfer.privacy.metadata import MetadataConfig, metadata_section, score
from splitinfer.privacy.table import BEGIN, END, write_tables

from synthetic_traffic import ROW, traces

FIELDS = {"side", "depth", "threat", "attacker", "defence", "top1", "top1_ci", "top5", "baseline_top1",
          "baseline_top1_ci", "ceiling", "n_tokens", "n_documents", "outcomes_top1_hex", "exact_sequence"}


def synthetic_traffic() -> dict:
    out = {}
    for pad, padded in ((0, False), (33, True)):
        known = traces(15, padded, 1)
        out[pad] = {"own": traces(15, padded, 2, "own"), "known": known, "victim": traces(15, padded, 1)}
    return out


def test_rows_have_the_audit_fields_and_padding_brings_the_steps_to_chance():
    rows = score(synthetic_traffic(), ROW, MetadataConfig(), depth=2, n_boot=50)
    assert all(FIELDS <= set(r) for r in rows) and {r["threat"] for r in rows} == {"T6"}
    assert {(r["side"], r["defence"]) for r in rows} == {(s, d) for s in ("accepted", "category", "document")
                                                       for d in ("none", "padding 33 rows")}
    best = {(r["side"], r["defence"]): r for r in sorted(rows, key=lambda r: r["top1"])}
    assert best[("accepted", "none")]["top1"] > 0.9
    padded = best[("accepted", "padding 33 rows")]
    assert padded["top1"] <= padded["baseline_top1"] + 0.05
    assert best[("document", "none")]["baseline_top1"] == 1 / 15
    for r in rows:
        assert r["top1_ci"][0] <= r["top1"] <= r["top1_ci"][1] + 1e-9
    json.dumps(rows)  # audit.json holds them as they are


def test_the_threat_table_gives_t6_rows_of_their_own(tmp_path):
    rows = score(synthetic_traffic(), ROW, MetadataConfig(), depth=2, n_boot=20)
    audit = tmp_path / "audit.json"
    audit.write_text(json.dumps({"results": rows, "metadata": {}}))
    doc, short = tmp_path / "doc.md", tmp_path / "short.md"
    for path in (doc, short):
        path.write_text(f"{BEGIN}\n{END}\n")
    write_tables([audit], [doc], 2, [short])
    text = doc.read_text()
    assert "TLS; T6 below" in text and "`--pad-rows 33`" in text
    t6 = [line for line in text.splitlines() if line.startswith("| a network observer, TLS intact | ")]
    assert len(t6) == 3  # the main table's pointer, then one row per padding setting
    assert "T6" not in short.read_text()  # the short table keeps its columns
    assert any("padding 33 rows" in line for line in metadata_section({"results": rows, "metadata": {}}))
