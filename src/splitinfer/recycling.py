"""`splitinfer drafter recycling`: the warm-start successor table, from the model's own greedy generations,
and beside it the replies themselves, searchable by suffix (decoding/sources.py `ReplyStore`).

    splitinfer drafter recycling --shards shards/smollm2 --out src/splitinfer/data/drafters/smollm2

The whole model runs in this process (local-only). For each offline prompt (offline.py: stdlib
docstrings and synthetic instructions, never the benchmark or held-out prompts) it generates a greedy
continuation, runs prompt + continuation through the model once more for every row's logits, and averages
each token's next-token distribution over its occurrences (warm.aggregate_successors). The table and
a manifest (model identity, data hash, seed, counts, time) go to --out; a client loads the table for the
same model, whatever its split (warm.shipped_recycling_table).

    splitinfer drafter recycling --shards shards/smollm2 --from-data DIR/data.pt --out DIR2

reads the generations `drafter train` collected instead (its data.pt: the model's own greedy and sampled
replies with every row's final features, far more text than this command generates in the same time) and
reads each row's distribution out through the model's final norm and LM head.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError
from .options import SHARDS, Opt, Shared, add_options, defer


def build_recycling_table(shards: Path, prompts: int, max_new_tokens: int, k: int, seed: int):
    """The table and its manifest; deterministic for a seed on one Python and model."""
    import torch

    from .clients import open_client
    from .local.session import SplitSession
    from .offline import offline_prompts, prompts_hash
    from .progress import progress
    from .decoding.warm import FORMAT, aggregate_successors
    from .model.manifest import model_identity

    torch.manual_seed(seed)
    client = open_client(local_only=True, shards=shards)
    chosen = offline_prompts(prompts, seed)
    rows, replies, generated = [], [], 0
    t0 = time.perf_counter()
    for p in progress(chosen, desc="drafter recycling", unit="prompt"):
        ids = client.encode_prompt(p["prompt"], chat=True)
        out = client.generate(ids, max_new_tokens=max_new_tokens, strategy="sequential").token_ids
        generated += len(out)
        replies.append(out)
        full = ids + out
        with SplitSession(client.local, client.make_middle(), client.config) as session:
            rows.append((full, session.prefill(full, logits_rows=len(full))))  # [len(full), vocab]
    table, seen = aggregate_successors(rows, k)
    manifest = {
        "format": FORMAT,
        "model_id": client.local.manifest.get("model_id"),
        "model_fingerprint": model_identity(client.local.manifest),
        "k": k,
        "seed": seed,
        "prompts": len(chosen),
        "prompt_categories": {c: sum(p["category"] == c for p in chosen) for c in sorted({p["category"] for p in chosen})},
        "data_sha256": prompts_hash(chosen),
        "python": sys.version.split()[0],
        "max_new_tokens": max_new_tokens,
    } | _made(table, generated, sum(len(tokens) for tokens, _ in rows), t0)
    return _with_replies(table, manifest, replies)


def _with_replies(table: dict, manifest: dict, replies: list[list[int]]):
    """The table with its replies as a ReplyStore, and the store's size in the manifest."""
    from .decoding.sources import ReplyStore
    from .decoding.warm import RecyclingTable

    store = ReplyStore([list(r) for r in replies])
    return RecyclingTable(table, manifest | {"replies": len(store.docs), "reply_tokens": len(store.order)}, store)


def _made(table: dict, generated: int, rows: int, t0: float) -> dict:
    """The manifest's record of how much went in and when, by which command."""
    from . import __version__

    return {
        "generated_tokens": generated,
        "rows": rows,
        "table_tokens": len(table),
        "wall_s": round(time.perf_counter() - t0, 1),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "splitinfer": __version__,
        "command": "splitinfer drafter recycling " + " ".join(shlex.quote(a) for a in sys.argv[3:]),
    }


def build_from_drafter_data(shards: Path, data_path: Path, k: int):
    """The table from drafter train's data.pt (its features read out through the final norm and LM head)."""
    import torch

    from .decoding.warm import FORMAT, aggregate_successors
    from .drafter.train import made_with
    from .model.manifest import model_identity, read_manifest
    from .model.shards import load_whole_hf
    from .progress import progress

    if not data_path.is_file():
        raise ConfigError(f"{data_path} does not exist; --from-data takes the data.pt a drafter train run wrote.")
    data = torch.load(data_path, weights_only=False)
    model = load_whole_hf(shards).requires_grad_(False)
    t0 = time.perf_counter()

    def rows():  # one reply's logits ([rows, vocab] floats) in memory at a time
        for s in progress(data["sequences"], desc="drafter recycling", unit="reply"):
            logits = model.lm_head(model.model.norm(s["features"].float()))  # row r predicts tokens[r + 1]
            yield s["tokens"][: logits.shape[0]], logits

    with torch.inference_mode():
        table, seen = aggregate_successors(rows(), k)
    local = read_manifest(shards / "local", "local")
    manifest = {
        "format": FORMAT,
        "model_id": local.get("model_id"),
        "model_fingerprint": model_identity(local),  # what a client loads it for, as above
        "k": k,
        "source": "drafter train data",
        "seed": data["config"].get("seed"),
        "prompts": len(data["sequences"]),
        "data_config": made_with(data["config"], ("tokens", "prompts", "seed", "max_new_tokens", "sampled_share",
                                                  "generate_dtype", "corpus")),
        "data_sha256": data["sha256"],
    } | _made(table, data["generated_tokens"], sum(seen.values()), t0)
    return _with_replies(table, manifest, [s["tokens"][s["prompt_len"] :] for s in data["sequences"]])


@dataclass(frozen=True)
class RecyclingOptions:
    """`splitinfer drafter recycling`'s defaults."""

    prompts: int = 96  # offline prompts to generate from
    max_new_tokens: int = 96  # greedy tokens generated per prompt
    k: int = 8  # successors kept per token
    seed: int = 0  # which offline prompts are drawn


def _options(s: argparse.ArgumentParser) -> None:
    add_options(s, Shared, (SHARDS,))
    s.add_argument("--out", required=True, help="folder for recycling.safetensors and recycling.json")
    add_options(s, RecyclingOptions, (
        Opt("prompts", help="offline prompts to generate from"),
        Opt("max_new_tokens", help="greedy tokens generated per prompt"),
        Opt("k", help="successors kept per token"),
        Opt("seed", help="which offline prompts are drawn"),
    ))
    s.add_argument("--from-data", default=None,
                   help="a drafter train data.pt: build from its generations instead of generating (--prompts, "
                        "--max-new-tokens and --seed are then the data's own)")


def cmd_build_recycling(args) -> int:
    if args.prompts < 1 or args.max_new_tokens < 1 or args.k < 1:
        raise ConfigError("--prompts, --max-new-tokens and --k must be at least 1.")
    if args.from_data:
        table = build_from_drafter_data(Path(args.shards), Path(args.from_data), args.k)
    else:
        table = build_recycling_table(Path(args.shards), args.prompts, args.max_new_tokens, args.k, args.seed)
    path = table.save(args.out)
    m = table.manifest
    print(f"{path}: {m['table_tokens']} tokens x {m['k']} successors from {m['prompts']} prompts "
          f"({m['generated_tokens']} generated tokens, {m['wall_s']} s), and {m['reply_tokens']} reply tokens "
          "searchable by suffix")
    return 0


def register(sub) -> None:
    s = sub.add_parser("recycling", help="warm-start table for Token Recycling from the model's own generations")
    defer(s, _options)
    s.set_defaults(func=cmd_build_recycling)
