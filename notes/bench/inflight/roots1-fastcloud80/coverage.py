"""How often the token chosen after a block is among the first k candidate roots that Tree.predict gives
(first level of its predicted tree, by score), replaying the greedy generations of a bench-spec run with
teacher-forced logits of the whole model (sequential decoding: the kept rows are known)."""
import json, sys
from pathlib import Path
import torch
from splitinfer.decoding.draft import Draft
from splitinfer.decoding.roots import candidate_roots
from splitinfer.decoding.strategies import make_strategy
from splitinfer.model.shards import load_whole_hf

run = json.load(open(sys.argv[1]))
model = load_whole_hf(Path(sys.argv[2]))
ks = [1, 2, 3, 4, 6, 8, 12, 16]
hits = {k: 0 for k in ks}
score_sum = {k: 0.0 for k in ks}
total = 0
seen = set()
for r in run["runs"]:
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
print(f"{total} next tokens over {len(seen)} prompts")
print("k | hit rate | mean summed score")
for k in ks:
    print(f"{k} | {hits[k] / total:.3f} | {score_sum[k] / total:.3f}")
