"""Teacher-forced accuracy by depth of several draft heads on the same held-out conversations.

Each `drafter train` manifest measures its head on its own data's held-out rows, which differ from one
data source to another; this scores every head given on the held-out conversations of one teacher-forced
shard directory (drafter/teacher.py), with the function the manifests use (drafter/unroll.py: accuracy).
A fused head reads the states stored beside the shards, so they must hold them. Writes JSON to --out.

    python scripts/drafter_heldout.py --shards shards/smollm2 --teacher RUN/teacher --tokens 620000 \
        --out heldout.json HEAD_DIR [HEAD_DIR ...]
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch

from splitinfer.drafter import teacher
from splitinfer.drafter.train import REPORTED_DEPTH, TrainConfig, split_heldout
from splitinfer.drafter.unroll import accuracy
from splitinfer.model.drafthead import load_head
from splitinfer.model.shards import load_whole_hf


def score(shards: Path, shard_dir: Path, tokens: int, heads: list[str]) -> dict:
    """{head directory: accuracy by depth} on the held-out conversations of the first `tokens` rows."""
    model = load_whole_hf(shards).requires_grad_(False)
    fused = bool(teacher.read_index(shard_dir)["config"].get("fused_layers"))
    _, heldout = split_heldout(teacher.load_sequences(shard_dir, tokens, fused=fused), TrainConfig().heldout_every)
    scores = {}
    for directory in heads:
        head = load_head(directory, model.model.embed_tokens, model.model.norm, model.lm_head)
        rows = heldout if head.config.fused_layers else [{k: v for k, v in s.items() if k != "fused"} for s in heldout]
        scores[directory] = accuracy(head, rows, REPORTED_DEPTH, TrainConfig().window)
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("heads", nargs="+", help="draft head directories (drafter train --out)")
    parser.add_argument("--shards", default="shards/smollm2", help="the prepared model the heads draft for")
    parser.add_argument("--teacher", required=True, help="a teacher-forced shard directory (RUN/teacher)")
    parser.add_argument("--tokens", type=int, default=None, help="rows of the shards read (default: all)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--out", required=True, help="JSON file written")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    scores = score(Path(args.shards), Path(args.teacher), args.tokens, args.heads)
    command = "python scripts/drafter_heldout.py " + shlex.join(sys.argv[1:])
    Path(args.out).write_text(json.dumps({"command": command, "teacher": args.teacher, "scores": scores}, indent=2))
    for directory, result in scores.items():
        print(directory, " ".join(f"d{d['depth']}={d['top1']}" for d in result["depth"]))


if __name__ == "__main__":
    main()
