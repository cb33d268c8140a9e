"""Train a draft head (model/drafthead.py) on the model's own continuations; resumable and seeded.

Three stages, each kept in the output directory so a run can stop and resume where it was, each in its own
module: 1. the data (data.py: data.pt, or teacher-forced shards under teacher/); 2. training (training.py:
checkpoint.pt, checkpoint-stable.pt); 3. the head (head.safetensors + head.json) and manifest.json (data
hash, seed, steps, losses, held-out losses and teacher-forced accuracy by depth from evaluation.py, wall
times, model fingerprint, token count). The options are config.py's `TrainConfig`; this module runs the
stages in order (`run_training`).

Every `heldout_every`-th sequence is held out of training: the held-out loss is recorded at each
checkpoint, and the manifest gives accuracy by depth on those sequences and on the model's greedy replies
to data/heldout.jsonl.

`fuse` (EAGLE-3's feature fusion, a measured option): the data also keep the two hidden states that cross
the wire at every row (the head layers' output, sent to the cloud, and the cloud layers' output, received
back), and the head adds them to its depth-1 input through a zero-initialised projection.

`with_data`: finished runs' data (their data.pt or teacher-forced shards, checked against their manifests)
are trained on beside this run's, each part holding out its own sequences; the manifest records every part.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

from ..errors import ConfigError
from ..model.drafthead import DraftHead, DraftHeadConfig
from ..model.manifest import basis_identity, model_identity, read_manifest
from .config import DATA, DATA_FIELDS, MANIFEST, REPORTED_DEPTH, TrainConfig, made_with
from .data import flag_heldout, load_or_collect, other_data, reply_prompts, split_heldout, wire_states
from .evaluation import heldout_replies, loss_summary, mtbench_accuracy
from .schedule import Schedule
from .training import draft_vocabulary, train_head
from .unroll import accuracy

# The names callers and tests reach through this module (the run's front door).
__all__ = ["DATA", "DATA_FIELDS", "MANIFEST", "REPORTED_DEPTH", "TrainConfig", "made_with", "reply_prompts",
           "run_training", "split_heldout"]


def run_training(shards: str | Path, out: str | Path, config: TrainConfig = TrainConfig()) -> dict:
    """Train a draft head for the model in `shards` (OUT/local + OUT/cloud) into `out`; returns the manifest."""
    shards, out = Path(shards), Path(out)
    if not (shards / "local").is_dir() or not (shards / "cloud").is_dir():
        raise ConfigError(f"{shards} is not a prepared shards directory (OUT/local + OUT/cloud); run `splitinfer prepare`.")
    Schedule.of(config)  # a schedule that cannot run fails now, not after the data
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)
    local_manifest = read_manifest(shards / "local", "local")
    fingerprint = model_identity(local_manifest)
    others = other_data(config, fingerprint)  # refused now, not after the data
    model, tokenizer, data = load_or_collect(shards, config, out)
    if others:
        data = data | {"sequences": flag_heldout(list(data["sequences"]), config.heldout_every)
                       + [s for part in others for s in part["sequences"]]}
    vocab = model.config.vocab_size
    training, heldout = split_heldout(data["sequences"], config.heldout_every)
    draft_vocab = draft_vocabulary(training, config.draft_vocab_size, vocab)
    torch.manual_seed(config.seed)
    head_config = DraftHeadConfig.for_model(model.config, config.draft_vocab_size, config.intermediate_size,
                                            wire_states(shards) if config.fuse else ())
    head = DraftHead(head_config, model.model.embed_tokens, model.model.norm, model.lm_head, draft_vocab.to(config.device),
                     getattr(model.config, "final_logit_softcapping", None)).to(config.device)
    state = train_head(head, data, config, out)
    head.save(out, extra={"model_fingerprint": fingerprint, "basis": basis_identity(local_manifest)})
    manifest = {
        "model_fingerprint": fingerprint,
        "data_sha256": data["sha256"],
        "generated_tokens": data["generated_tokens"] + sum(p["generated_tokens"] for p in others),
        "training_pairs": sum(len(s["tokens"]) - 2 for s in data["sequences"]),
        "prompts": data["prompts"] + sum(p["prompts"] for p in others),
        "seed": config.seed,
        "steps": state["step"],
        "generate_wall_s": round(data["generate_wall_s"] + sum(p["generate_wall_s"] for p in others), 1),
        "train_wall_s": round(state["wall_s"], 1),
        "losses": loss_summary(state["losses"]),
        "heldout_curve": state["heldout"],
        # Teacher-forced, the head on its own predictions: generated held-out sequences of the same data,
        # and the model's greedy replies to data/heldout.jsonl (prompts in no training or benchmark set).
        "heldout_accuracy": accuracy(head, heldout, REPORTED_DEPTH, config.window),
        "heldout_prompts_accuracy": accuracy(head, heldout_replies(model, tokenizer, config, head_config.fused_layers),
                                             REPORTED_DEPTH, config.window),
        "mtbench_accuracy": mtbench_accuracy(model, tokenizer, head, config),
        "config": asdict(config),
        "head": asdict(head_config),
    }
    if "source" in data:
        manifest["source"] = data["source"]
    if others:  # generated_tokens and generate_wall_s above count every part; data_sha256 is this run's own
        manifest["with_data"] = [{k: v for k, v in p.items() if k != "sequences"} for p in others]
    if data.get("fused_sha256"):
        manifest["fused_sha256"] = data["fused_sha256"]
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest
