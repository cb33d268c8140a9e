"""The threat-model table is written from audit rows, between markers, and says what to use instead."""

from __future__ import annotations

import json

import pytest

from splitinfer.errors import ConfigError
from splitinfer.privacy.table import BEGIN, END, INSTEAD, write_tables


def _row(threat, side, attacker, defence, top1, **extra):
    return {"threat": threat, "side": side, "attacker": attacker, "defence": defence, "depth": 2, "top1": top1,
            "baseline_top1": 0.1, **extra}


def test_table_picks_the_best_attacker_and_the_largest_n(tmp_path):
    rows = [
        _row("T0", "input", "A2", "none", 0.7), _row("T0", "input", "A4", "none", 1.0),
        _row("T3", "input", "A2", "secret basis", 0.05), _row("T3", "input", "A6 inner products", "secret basis", 0.12),
        _row("T5", "input", "A7 N=100 + A2", "secret basis", 0.3, known_pairs=100),
        _row("T5", "input", "A7 N=10000 + A2", "secret basis", 0.2, known_pairs=10000),
    ]
    audit = tmp_path / "audit.json"
    audit.write_text(json.dumps({"results": rows}))
    doc = tmp_path / "doc.md"
    doc.write_text(f"intro\n{BEGIN}\nold table\n{END}\nafter\n")
    short = tmp_path / "readme.md"
    short.write_text(f"{BEGIN}\n{END}\n")
    text = write_tables([audit], [doc], short_targets=[short])
    short_lines = [line for line in short.read_text().splitlines() if line.startswith("| ")]
    assert all(line.count(" | ") == 3 for line in short_lines), short_lines  # four columns
    assert "**100.0%** (A4; prior 10.0%)" in short.read_text() and "(T0)" not in short.read_text()
    lines = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| ")}
    written = doc.read_text()
    assert written.startswith("intro\n") and written.endswith("after\n") and "old table" not in written
    assert text in written
    reader = lines["| anyone who reads logs, dumps or a tap behind TLS, without the cloud shard"]
    assert "**100.0%** (A4; prior 10.0%)" in reader and INSTEAD in reader
    basis = lines["| the same reader, deployment in a secret rotation (`privatize --basis --key orthogonal`)"]
    assert "**12.0%** (A6 inner products" in basis and INSTEAD not in basis and "not measured" in basis
    known = lines["| the host or a log reader holding known (text, activation) pairs, secret basis"]
    assert "**20.0%** (A7 N=10000 + A2" in known  # the largest N, not the best N


def test_table_needs_markers_and_files(tmp_path):
    audit = tmp_path / "audit.json"
    audit.write_text(json.dumps({"results": []}))
    doc = tmp_path / "doc.md"
    doc.write_text("no markers\n")
    with pytest.raises(ConfigError, match="markers"):
        write_tables([audit], [doc])
    with pytest.raises(ConfigError, match="does not exist"):
        write_tables([tmp_path / "missing.json"], [])
