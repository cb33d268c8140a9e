"""`splitinfer bench drafting`: what drafting a tree costs a step, without a model: stored generations replayed
through the tree strategy.

Each generation's prompt starts a `Tree` (the shipped successor table and replies, as a client's); then, step by
step, `propose` drafts from the text so far, the step accepts what the stored reply says next (the longest path
of the draft that the reply follows, and the token after it), and the strategy learns from that as it does from
a verified block (the copy calibration, the suffix index, the cost controller, fed 90 ms + 0.8 ms a row). The
successor table keeps its shipped rows (no logits here). Timed: `propose` alone, each step either right after
the previous one (warm caches) or after writing 96 MB (cold: as after the LM head and a cloud step have streamed
their weights through the caches). The digest hashes every draft (tokens, parents, scores): equal digests,
equal drafts.

--replies: a `bench spec` speculative.json (its tree generations are taken and saved as OUT/replay.json) or a
replay.json written so. Writes OUT/drafting.json and OUT/drafting.md.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from pathlib import Path

import torch

from ..decoding.controller import StepCosts
from ..decoding.draft import children_of
from ..decoding.tree import Tree, TreeConfig
from ..decoding.warm import RecyclingTable, shipped_table_dirs
from ..launch import pinned
from ..tables import table
from .harness import command_line, write

COLD_BYTES = 96 * 2**20


def load_replies(path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    if isinstance(data, list):
        return data
    return [{"prompt": r["prompt_token_ids"], "reply": r["token_ids"]} for r in data["runs"] if r["strategy"] == "tree"]


def accepted(draft, root: int, reply: list[int], i: int) -> list[int]:
    """The block rows of the draft that reply[i:] follows, the root first."""
    children = children_of(*draft.block(root))
    path, row = [0], 0
    while i < len(reply) and reply[i] in children.get(row, {}):
        row = children[row][reply[i]]
        path.append(row)
        i += 1
    return path


def replay(replies: list[dict], table_: RecyclingTable, cold: bool, digest) -> list[float]:
    """ms of every propose over the replies, in one pass."""
    costs, times = StepCosts(), []
    sink = torch.ones(COLD_BYTES // 4)
    for item in replies:
        tree = Tree(TreeConfig(), costs=costs, recycling_table=table_)
        prompt, reply = item["prompt"], item["reply"]
        tree.start(prompt, torch.zeros(0, 64))  # no prompt logits: the table stays as shipped
        history, i = [*prompt, reply[0]], 1
        while i < len(reply):
            if cold:
                sink.add_(1.0)
            t0 = time.perf_counter()
            draft = tree.propose(history)
            times.append((time.perf_counter() - t0) * 1e3)
            digest.update(repr((draft.tokens, draft.parents, [round(s, 9) for s in draft.scores])).encode())
            path = accepted(draft, history[-1], reply, i)
            emitted = reply[i : i + len(path)]
            tree.calibration.observe(draft.keys, draft.parents, set(path))
            tree.index.extend(tree.doc, emitted)
            rows = len(draft) + 1
            tree.controller.observe(rows, 90 + 0.8 * rows, sum(draft.scores), len(path) - 1)
            history += emitted
            i += len(emitted)
    return times


def measure(replies: list[dict], repeats: int) -> tuple[dict[str, list[float]], str]:
    """ms of every propose, warm and cold, over `repeats` passes after an untimed one; the drafts' digest."""
    table_ = RecyclingTable.load(shipped_table_dirs()[0])
    digest, runs = hashlib.sha256(), {"warm": [], "cold": []}
    replay(replies, table_, False, hashlib.sha256())  # warm-up pass, not timed
    for _ in range(repeats):
        for mode in runs:
            runs[mode] += replay(replies, table_, mode == "cold", digest)
    return runs, digest.hexdigest()[:16]


def run(args, log=print) -> dict:
    replies_path, out = Path(args.replies), Path(args.out)
    replies = load_replies(replies_path)
    out.mkdir(parents=True, exist_ok=True)
    if replies_path.name != "replay.json":
        (out / "replay.json").write_text(json.dumps(replies) + "\n")
    with pinned(None, 1):  # one torch thread, in the record's provenance too
        runs, drafts = measure(replies, args.repeats)
        rows = [[mode, len(ms), round(statistics.median(ms), 3), round(statistics.mean(ms), 3)]
                for mode, ms in runs.items()]
        report = {"generations": len(replies), "drafts_sha256": drafts, "rows": rows,
                  "replies_sha256": hashlib.sha256(replies_path.read_bytes()).hexdigest()[:16]}
        body = [f"{len(replies)} stored generations (replies {report['replies_sha256']}), {args.repeats} passes each "
                f"warm and cold after one untimed pass; ms of `Tree.propose` a step. Drafts digest {drafts}.", "",
                *table(["caches", "steps", "median ms", "mean ms"], rows)]
        write(out, "drafting", report, body, title="Drafting a tree, replayed without a model",
              command=command_line(args), log=log)
    return report
