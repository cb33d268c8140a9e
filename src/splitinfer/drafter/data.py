"""The draft head's training data: prompts, the whole model's continuations of them and their features.

data.pt holds chat prompts (from offline text, drafter/corpus.py, or ShareGPT's first user turns: source
sharegpt-replies), the whole model's greedy and sampled continuations of them (drafter/generate.py, batches
of prompts of similar length), and the final features before the final norm of every row, captured while
generating; its sha256 goes into the manifest. While it is being collected, data.partial.pt holds the
batches done so far. (Source sharegpt, teacher-forced conversations, keeps appendable shards under teacher/
instead: drafter/teacher.py.) `with_data`: finished runs' data, checked against their manifests, are
trained on beside this run's (`other_data`). Every `heldout_every`-th sequence is held out (`split_heldout`).

It knows nothing about the head or its training (training.py).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ..errors import ConfigError
from ..model.manifest import read_manifest
from ..model.shards import load_whole_hf
from ..progress import progress
from .config import DATA, DATA_FIELDS, MANIFEST, PARTIAL, TEACHER, TrainConfig, made_with
from .corpus import build_prompts
from .generate import Sampling, generate_rows


def generate_batch(model, tokenizer, prompts: list[list[int]], config: TrainConfig, sampled: bool, seed: int,
                    fused_layers: tuple[int, ...] = ()) -> list[dict]:
    """Batched continuations (drafter/generate.py) -> per prompt {"tokens", "prompt_len", "features" [len - 1,
    d] fp16, and "fused" [len - 1, F d] fp16 with `fused_layers`}."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rows = generate_rows(model, prompts, config.max_new_tokens, pad, set(_eos_ids(model.config, tokenizer)),
                         Sampling() if sampled else None, seed, fused_layers)
    names = ("tokens", "features", "fused")  # a row holds the fused states only with `fused_layers`
    return [{"prompt_len": len(p), **dict(zip(names, row))} for p, row in zip(prompts, rows)]


def wire_states(shards: Path) -> tuple[int, int]:
    """The hidden states (HF numbering) that cross the wire in `shards`' split: the head layers' output
    and the cloud layers' output, both on the trusted side at run time."""
    split = read_manifest(shards / "local", "local")["split"]
    return int(split["head_layers"]), int(split["cloud_layers"][1])


def _eos_ids(config, tokenizer) -> list[int]:
    ids = []
    for source in (getattr(config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        ids += [source] if isinstance(source, int) else list(source or [])
    return ids


def _length_batches(prompts: list[list[int]], size: int, seed: int) -> list[list[list[int]]]:
    """Batches of prompts of similar length (little left padding), in an order shuffled for `seed` so that
    stopping at the token target does not favour short prompts."""
    import random

    ordered = sorted(prompts, key=len)
    batches = [ordered[i : i + size] for i in range(0, len(ordered), size)]
    random.Random(seed).shuffle(batches)
    return batches


def generator_model(model, dtype: str):
    """The model that generates the data: `model` itself in float32, else a copy cast to `dtype` (the
    head's readout keeps using `model`'s own float32 weights)."""
    import copy

    return model if dtype == "float32" else copy.deepcopy(model).to(getattr(torch, dtype))


def template_prompts(tokenizer, config: TrainConfig) -> list[list[int]]:
    """`config.prompts` chat prompts from the offline corpus (drafter/corpus.py)."""
    from ..local.text import chat_prompt_ids

    return [chat_prompt_ids(tokenizer, [{"role": "user", "content": p}]) for p in build_prompts(config.prompts, config.seed, config.corpus)]


def reply_prompts(tokenizer, config: TrainConfig) -> tuple[list[list[int]], dict]:
    """The first user turns of the usable ShareGPT conversations (drafter/chat.py) outside the held-out ids,
    chat-templated, at most `max_len - max_new_tokens` tokens long, shuffled for `seed`, at most
    `config.prompts` of them from the `config.first_prompt`-th on -> (prompts, the data's source record)."""
    import random

    from ..local.text import chat_prompt_ids
    from . import chat

    kept, source = chat.usable_sharegpt()
    turns = [c["messages"][0]["content"] for c in kept if not c["heldout"]]
    random.Random(config.seed).shuffle(turns)
    longest = config.max_len - config.max_new_tokens
    prompts = [ids for ids in (chat_prompt_ids(tokenizer, [{"role": "user", "content": t}]) for t in turns) if len(ids) <= longest]
    drawn = prompts[config.first_prompt : config.first_prompt + config.prompts]
    if config.first_prompt and not drawn:
        raise ConfigError(f"--first-prompt {config.first_prompt} is past the {len(prompts)} usable first turns; "
                          "give a smaller one.")
    return drawn, source | {"first_turns": len(turns), "short_enough": len(prompts)}


def collect_data(model, tokenizer, config: TrainConfig, out: Path, prompts: list[list[int]],
                 fused_layers: tuple[int, ...] = ()) -> dict:
    """Prompts -> continuations and features until `config.tokens` generated tokens are collected (or the
    prompts run out), by the model cast to `config.generate_dtype`. The
    batches so far are saved to out/data.partial.pt after each one, and a rerun goes on from there (each
    batch's prompts and seed depend only on its index, so the data are the same)."""
    partial = out / PARTIAL
    saved = torch.load(partial, weights_only=False) if partial.exists() else None
    # The batches are the same whatever the token target, so any target may go on from saved batches.
    same = {k: getattr(config, k) for k in DATA_FIELDS if k != "tokens"}
    if saved is not None and made_with(saved["config"], same) == same:
        sequences, generated, done, wall = saved["sequences"], saved["generated"], saved["batches"], saved["wall_s"]
    else:
        sequences, generated, done, wall = [], 0, 0, 0.0
    started = time.perf_counter() - wall
    generator = generator_model(model, config.generate_dtype)
    with progress(total=config.tokens, initial=generated, desc="generate", unit="tok", enabled=True) as bar:
        for index, batch in enumerate(_length_batches(prompts, config.generate_batch, config.seed)):
            if generated >= config.tokens:
                break
            if index < done:
                continue
            # Spread the sampled batches evenly among the greedy ones.
            sampled = math.floor((index + 1) * config.sampled_share) > math.floor(index * config.sampled_share)
            sequences += generate_batch(generator, tokenizer, batch, config, sampled, config.seed * 100_003 + index,
                                         fused_layers)
            new = sum(len(s["tokens"]) for s in sequences[-len(batch):]) - sum(len(p) for p in batch)
            generated += new
            bar.update(new)
            torch.save({"config": {k: getattr(config, k) for k in DATA_FIELDS}, "sequences": sequences,
                        "generated": generated, "batches": index + 1, "wall_s": time.perf_counter() - started},
                       partial.with_suffix(".tmp"))
            partial.with_suffix(".tmp").replace(partial)
    return {"sequences": sequences, "generated_tokens": generated, "sha256": tokens_hash(sequences), "prompts": len(sequences),
            "generate_wall_s": round(time.perf_counter() - started, 1)}


def load_or_collect(shards: Path, config: TrainConfig, out: Path):
    """The whole model and tokenizer, and the training data (read from out/data.pt when present)."""
    from transformers import AutoTokenizer

    model = load_whole_hf(shards).to(config.device).requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(shards / "local", local_files_only=True)
    tokenizer.padding_side = "left"
    fused_layers = wire_states(shards) if config.fuse else ()
    if config.source == "sharegpt":
        return model, tokenizer, collect_chat(model, tokenizer, config, out, fused_layers)
    if (out / DATA).exists():
        data = torch.load(out / DATA, weights_only=False)
        if made_with(data["config"]) != {k: getattr(config, k) for k in DATA_FIELDS}:
            raise ConfigError(f"{out} holds data made with other options; use another --out or the same options.")
    else:
        source = None
        if config.source == "sharegpt-replies":
            prompts, source = reply_prompts(tokenizer, config)
        else:
            prompts = template_prompts(tokenizer, config)
        data = collect_data(model, tokenizer, config, out, prompts, fused_layers) | {"config": asdict(config)}
        if source is not None:
            data["source"] = source
        torch.save(data, out / DATA)
        (out / PARTIAL).unlink(missing_ok=True)
    return model, tokenizer, data


def collect_chat(model, tokenizer, config: TrainConfig, out: Path, fused_layers: tuple[int, ...] = ()) -> dict:
    """ShareGPT conversations, teacher-forced into appendable shards under out/teacher (drafter/teacher.py),
    read back as memory-mapped sequences; a rerun appends after the last finished shard."""
    from . import chat, teacher

    kept, source = chat.usable_sharegpt()
    tconfig = teacher.TeacherConfig(tokens=config.tokens, max_len=config.max_len, dtype=config.generate_dtype,
                                    seed=config.seed, fused_layers=fused_layers)
    labeller = generator_model(model, config.generate_dtype)
    index = teacher.collect(labeller, tokenizer, kept, out / TEACHER, tconfig,
                            {"sharegpt": chat.SHAREGPT_SOURCE, "mtbench": chat.MTBENCH_SOURCE})
    sequences = teacher.load_sequences(out / TEACHER, config.tokens, fused=bool(fused_layers))
    return {"sequences": sequences, "sha256": teacher.data_hash(index), "fused_sha256": teacher.fused_hash(index) if fused_layers else None,
            "prompts": len(sequences),
            "generated_tokens": sum(len(s["tokens"]) for s in sequences), "generate_wall_s": index["wall_s"],
            "source": index["source"] | source, "config": asdict(config)}


def flag_heldout(sequences: list[dict], every: int) -> list[dict]:
    """`sequences` with the "heldout" flag split_heldout would give them (teacher-forced ones have their own)."""
    for i, s in enumerate(sequences):
        s.setdefault("heldout", i % every == every - 1)
    return sequences


def split_heldout(sequences: list[dict], every: int) -> tuple[list[dict], list[dict]]:
    """(training, held-out): every `every`-th sequence is held out from training and measures it (or those
    flagged "heldout", as teacher-forced conversations are, by id): `_flag_heldout`'s flags."""
    flagged = flag_heldout(sequences, every)
    return [s for s in flagged if not s["heldout"]], [s for s in flagged if s["heldout"]]


def other_data(config: TrainConfig, fingerprint: str) -> list[dict]:
    """The data of the finished runs in `config.with_data`: per run {"out", "sequences", "source", "data_sha256",
    "generated_tokens", "prompts", "generate_wall_s"}; a run of another model, fused otherwise, or whose data
    no longer match its manifest's hash is refused."""
    from . import teacher

    parts = []
    for name in filter(None, (d.strip() for d in config.with_data.split(","))):
        path = Path(name)
        if not (path / MANIFEST).exists():
            raise ConfigError(f"--with-data {path}: no finished drafter run there ({MANIFEST} is missing); "
                              "train there first or leave it out.")
        manifest = json.loads((path / MANIFEST).read_text())
        made = made_with(manifest["config"])
        if manifest["model_fingerprint"] != fingerprint or made["fuse"] != config.fuse:
            raise ConfigError(f"--with-data {path}: its data are of another model or fused otherwise "
                              f"(fuse={made['fuse']}); give runs of these shards with the same --fuse.")
        if made["source"] == "sharegpt":
            sequences = teacher.load_sequences(path / TEACHER, made["tokens"], fused=config.fuse)
            digest = teacher.data_hash(teacher.read_index(path / TEACHER))
        else:
            sequences = torch.load(path / DATA, weights_only=False)["sequences"]
            digest = tokens_hash(sequences)
        if digest != manifest["data_sha256"]:
            raise ConfigError(f"--with-data {path}: its data no longer match its manifest's data_sha256.")
        parts.append({"out": str(path), "sequences": flag_heldout(sequences, config.heldout_every),
                      "source": made["source"]} | {k: manifest[k] for k in ("data_sha256", "generated_tokens", "prompts", "generate_wall_s")})
    return parts


def tokens_hash(sequences: list[dict]) -> str:
    return hashlib.sha256(json.dumps([s["tokens"] for s in sequences]).encode()).hexdigest()
