"""How often the token chosen after a block is among the first k candidate roots that Tree.predict gives
(first level of its predicted tree, by score), replaying the greedy generations of a `bench spec` run with
teacher-forced logits of the whole model (sequential decoding: the kept rows are known).

    PYTHONPATH=src python scripts/root_coverage.py notes/bench/inflight/roots1-fastcloud80/speculative.json shards/smollm2

A lab script (notes/bench/inflight/roots1-fastcloud80/coverage.md quotes its output); tests/test_root_coverage.py
runs it on a tiny model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from splitinfer.decoding.draft import Draft
from splitinfer.decoding.roots import candidate_roots
from splitinfer.decoding.strategies import make_strategy

KS = (1, 2, 3, 4, 6, 8, 12, 16)  # candidate roots counted


def coverage(runs: list[dict], model, ks: tuple[int, ...] = KS) -> dict:
    """{"tokens", "prompts", "rows": [{"k", "hit_rate", "mean_score"}]} over the first run of each prompt in
    `runs` (records with prompt_id, prompt_token_ids and token_ids) under `model` (a whole HF causal LM)."""
    hits = {k: 0 for k in ks}
    score_sum = {k: 0.0 for k in ks}
    total = 0
    seen = set()
    for r in runs:
        if r["prompt_id"] in seen:
            continue
        seen.add(r["prompt_id"])
        prompt, out = r["prompt_token_ids"], r["token_ids"]
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + out])).logits[0].float()
        tree = make_strategy("tree-nohead")
        tree.start(prompt, logits[max(0, len(prompt) - 256): len(prompt)])
        for i in range(1, len(out)):
            h = prompt + out[:i]
            roots, scores, _ = candidate_roots(tree.predict(h, 48), 16, 0.0, 0)
            total += 1
            for k in ks:
                hits[k] += out[i] in roots[:k]
                score_sum[k] += sum(scores[:k])
            tree.recall(Draft())
            tree.observe([h[-1]], [-1], logits[len(h) - 1: len(h)], [0], [out[i]], 100.0)
    rows = [{"k": k, "hit_rate": hits[k] / max(total, 1), "mean_score": score_sum[k] / max(total, 1)} for k in ks]
    return {"tokens": total, "prompts": len(seen), "rows": rows}


def main(argv: list[str]) -> int:
    from splitinfer.model.shards import load_whole_hf

    run = json.loads(Path(argv[0]).read_text())
    result = coverage(run["runs"], load_whole_hf(Path(argv[1])))
    print(f"{result['tokens']} next tokens over {result['prompts']} prompts")
    print("k | hit rate | mean summed score")
    for row in result["rows"]:
        print(f"{row['k']} | {row['hit_rate']:.3f} | {row['mean_score']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
