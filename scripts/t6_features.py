"""Which traffic features carry the prompt category (threat T6), with and without padding.

Re-attacks the traffic a metadata audit recorded (`splitinfer privacy audit --metadata-only` writes
traffic.json) with the audit's category attacker (privacy/traffic.py: k nearest neighbours over
per-generation features, the same two folds) given one group of features at a time, and all groups but
one. Writes features.json and features.md to --out.

    python scripts/t6_features.py --traffic notes/privacy/metadata/traffic.json --out notes/privacy/metadata
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from splitinfer.privacy.metadata import MetadataConfig, load_traffic
from splitinfer.privacy.traffic import attack_category
from splitinfer.tables import table

GROUPS = {  # columns of privacy/traffic.py's generation_features
    "decode steps": [0],
    "prompt messages and bytes": [1, 2],
    "decode message sizes": [3, 4, 5],
    "round trips": [6, 7],
    "think times": [8, 9],
}


def scored(sets: dict, columns: list[int], k: int) -> tuple[float, float, int]:
    """(recovered, chance, test items) pooled over the audit's two folds."""
    folds = ((sets["own"], sets["victim"]), (sets["known"], sets["own"]))
    runs = [attack_category(a, b, columns, k) for a, b in folds]
    hits = np.concatenate([r.hits for r in runs])
    chance = np.concatenate([r.chance_hits for r in runs])
    return float(hits.mean()), float(chance.mean()), len(hits)


def measure(traffic: dict, k: int) -> list[dict]:
    everything = sorted(c for cols in GROUPS.values() for c in cols)
    rows = []
    for pad, sets in traffic.items():
        for name, cols in [("all", everything), *GROUPS.items()]:
            recovered, chance, n = scored(sets, cols, k)
            rows.append({"pad_rows": pad, "features": name, "only": True, "recovered": recovered, "chance": chance, "n": n})
        for name, cols in GROUPS.items():
            recovered, chance, n = scored(sets, [c for c in everything if c not in cols], k)
            rows.append({"pad_rows": pad, "features": f"all but {name}", "only": False, "recovered": recovered,
                         "chance": chance, "n": n})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traffic", required=True, help="traffic.json of a metadata audit")
    parser.add_argument("--out", required=True, help="directory for features.json and features.md")
    args = parser.parse_args(argv)
    k = MetadataConfig().generation_neighbours
    rows = measure(load_traffic(args.traffic), k)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python scripts/t6_features.py " + " ".join(sys.argv[1:])
    (out / "features.json").write_text(json.dumps({"command": command, "k": k, "groups": GROUPS, "rows": rows}, indent=1) + "\n")
    body = [["none" if r["pad_rows"] == "0" else r["pad_rows"], r["features"], f"{100 * r['recovered']:.1f}", f"{100 * r['chance']:.1f}", r["n"]]
            for r in rows]
    lines = ["# T6: the prompt category from each group of traffic features", "", f"`{command}`", "",
             f"The audit's category attacker (kNN, k = {k}, its two folds pooled) on the recorded traffic, given one "
             "group of per-generation features, or all groups but one.", "",
             *table(["padding (rows, +steps)", "features", "category recovered %", "chance %", "test generations"], body)]
    (out / "features.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
