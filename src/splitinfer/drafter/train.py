"""Train a draft head (model/drafthead.py) on the model's own continuations; resumable and seeded.

Three stages, each kept in the output directory so a run can stop and resume where it was:
1. data.pt: chat prompts from offline text (drafter/corpus.py), the whole model's greedy and sampled
   continuations of them (batched), and the final features before the final norm of every row, captured
   while generating; its sha256 goes into the manifest.
2. checkpoint.pt every `checkpoint_every` steps: head, optimiser, RNG state, loss curve, wall time.
3. The head (head.safetensors + head.json) and manifest.json (data hash, seed, steps, losses, wall time,
   model fingerprint, token count).

Loss per pair (f_t, x_{t+1}): SmoothL1 between the predicted and the true feature f_{t+1} (scaled by the
data's feature spread) + 0.1 x cross-entropy of the draft-vocabulary logits against x_{t+2}; input
features get a little uniform noise so the head tolerates its own prediction errors when chained.
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
from ..model.shards import load_whole_hf, model_identity, read_manifest
from ..progress import progress
from .corpus import build_prompts

DATA = "data.pt"
# The options that shape the data (the rest only shape training, and may change on a resume).
DATA_FIELDS = ("tokens", "seed", "device", "max_new_tokens", "generate_batch", "sampled_share")
CHECKPOINT = "checkpoint.pt"
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class TrainConfig:
    tokens: int = 8_000  # generated tokens (continuations) to train on
    steps: int = 300
    seed: int = 0
    device: str = "cpu"
    max_new_tokens: int = 128  # per continuation
    generate_batch: int = 16
    sampled_share: float = 0.5  # share of batches sampled (temperature 0.8) rather than greedy
    batch: int = 4  # windows per step
    window: int = 128  # pairs per window
    lr: float = 1e-3
    draft_vocab_size: int = 8192
    intermediate_size: int = 768
    noise: float = 0.05  # uniform input-feature noise, relative to each row's RMS
    checkpoint_every: int = 50


# -- 1. data --------------------------------------------------------------------------------------
def _capture_features(model) -> tuple[list, object]:
    """Collect the input of the final norm (pre-norm final features) on every forward call."""
    seen: list[torch.Tensor] = []
    handle = model.model.norm.register_forward_hook(lambda mod, args, out: seen.append(args[0].detach().float()))
    return seen, handle


@torch.inference_mode()
def _generate_batch(model, tokenizer, prompts: list[list[int]], config: TrainConfig, sampled: bool, seed: int):
    """Left-padded batched generation -> [(token ids, features [len - 1, d] fp16)] per prompt."""
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=config.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=config.device)
    torch.manual_seed(seed)
    seen, handle = _capture_features(model)
    try:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=config.max_new_tokens,
                             do_sample=sampled, temperature=0.8 if sampled else None, top_p=0.95 if sampled else None,
                             top_k=None, pad_token_id=pad)
    finally:
        handle.remove()
    features = torch.cat(seen, dim=1)  # [B, width + generated - 1, d]
    eos = set(_eos_ids(model.config, tokenizer))
    rows = []
    for b, prompt in enumerate(prompts):
        generated = out[b, width:].tolist()
        end = next((i + 1 for i, t in enumerate(generated) if t in eos), len(generated))
        tokens = prompt + generated[:end]
        rows.append((tokens, features[b, width - len(prompt) : width - 1 + end].half().cpu()))
    return rows


def _eos_ids(config, tokenizer) -> list[int]:
    ids = []
    for source in (getattr(config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        ids += [source] if isinstance(source, int) else list(source or [])
    return ids


def collect_data(model, tokenizer, config: TrainConfig) -> dict:
    """Prompts -> continuations and features until `config.tokens` generated tokens are collected."""
    from ..local.text import chat_prompt_ids

    count = max(1, math.ceil(config.tokens / (0.7 * config.max_new_tokens)))
    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": p}]) for p in build_prompts(count, config.seed)]
    sequences, generated = [], 0
    with progress(total=config.tokens, desc="generate", unit="tok", enabled=True) as bar:
        for index, start in enumerate(range(0, len(prompts), config.generate_batch)):
            if generated >= config.tokens:
                break
            batch = prompts[start : start + config.generate_batch]
            # Spread the sampled batches evenly among the greedy ones.
            sampled = math.floor((index + 1) * config.sampled_share) > math.floor(index * config.sampled_share)
            rows = _generate_batch(model, tokenizer, batch, config, sampled, config.seed * 100_003 + index)
            for prompt, (tokens, features) in zip(batch, rows):
                sequences.append({"tokens": tokens, "prompt_len": len(prompt), "features": features})
            new = sum(len(s["tokens"]) for s in sequences[-len(batch):]) - sum(len(p) for p in batch)
            generated += new
            bar.update(new)
    digest = hashlib.sha256(json.dumps([s["tokens"] for s in sequences]).encode()).hexdigest()
    return {"sequences": sequences, "generated_tokens": generated, "sha256": digest, "prompts": len(sequences)}


def draft_vocabulary(sequences: list[dict], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent token ids in the data (ties by id), topped up with the lowest unseen ids."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in sequences:
        counts += torch.bincount(torch.tensor(s["tokens"]), minlength=vocab_size)[:vocab_size]
    order = sorted(range(vocab_size), key=lambda i: (-int(counts[i]), i))
    return torch.tensor(order[:size], dtype=torch.long)


# -- 2. training ----------------------------------------------------------------------------------
def _windows(sequences: list[dict], window: int) -> list[tuple[int, int]]:
    """(sequence, start) of every window of up to `window` pairs; each needs 3 rows (f_t, x_t+1, x_t+2)."""
    return [(i, start) for i, s in enumerate(sequences) for start in range(0, max(1, len(s["tokens"]) - 2), window)
            if len(s["tokens"]) - start >= 3]


def _batch(sequences: list[dict], picks: list[tuple[int, int]], window: int, vocab_index: torch.Tensor, device: str):
    """Padded tensors for a step: features f_t, tokens x_t+1, targets f_t+1 and draft ids of x_t+2, mask."""
    d = sequences[0]["features"].shape[1]
    b = len(picks)
    feats, targets = torch.zeros(b, window, d), torch.zeros(b, window, d)
    tokens, ce = torch.zeros(b, window, dtype=torch.long), torch.full((b, window), -100, dtype=torch.long)
    mask = torch.zeros(b, window, dtype=torch.bool)
    for row, (i, start) in enumerate(picks):
        s = sequences[i]
        x, f = torch.tensor(s["tokens"]), s["features"].float()
        n = min(window, len(x) - 2 - start, f.shape[0] - 1 - start)
        feats[row, :n], targets[row, :n] = f[start : start + n], f[start + 1 : start + 1 + n]
        tokens[row, :n] = x[start + 1 : start + 1 + n]
        ce[row, :n] = vocab_index[x[start + 2 : start + 2 + n]]
        mask[row, :n] = True
    return [t.to(device) for t in (feats, tokens, targets, ce, mask)]


def _step_loss(head: DraftHead, batch, config: TrainConfig, scale: float, gen: torch.Generator):
    feats, tokens, targets, ce, mask = batch
    rms = feats.pow(2).mean(-1, keepdim=True).sqrt()
    noise = (torch.rand(feats.shape, generator=gen, device="cpu").to(feats.device) - 0.5) * 2 * config.noise * rms
    n = feats.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool, device=feats.device).tril()
    predicted, _, _ = head(feats + noise, tokens, torch.arange(n, device=feats.device), causal)
    feature_loss = F.smooth_l1_loss(predicted[mask] * scale, targets[mask] * scale)
    ce_loss = F.cross_entropy(head.logits(predicted).flatten(0, 1), ce.flatten(), ignore_index=-100)
    return feature_loss + 0.1 * ce_loss, feature_loss.item(), ce_loss.item()


def _lr(config: TrainConfig, step: int) -> float:
    warmup = max(1, config.steps // 20)
    if step < warmup:
        return config.lr * (step + 1) / warmup
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, config.steps - warmup))))


def _save_checkpoint(path: Path, head, optimiser, gen, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"head": head.state_dict(), "optimiser": optimiser.state_dict(), "rng": gen.get_state(), **state}, tmp)
    tmp.replace(path)


def train_head(head: DraftHead, data: dict, config: TrainConfig, out: Path, vocab_index: torch.Tensor) -> dict:
    """Train `head` for `config.steps`, resuming from out/checkpoint.pt; returns the training state."""
    sequences = data["sequences"]
    windows = _windows(sequences, config.window)
    all_features = torch.cat([s["features"][:256].float() for s in sequences[:64]])
    scale = 1.0 / float(all_features.std())
    optimiser = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=config.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(config.seed)
    state = {"step": 0, "losses": [], "wall_s": 0.0}
    if (out / CHECKPOINT).exists():
        saved = torch.load(out / CHECKPOINT, weights_only=False)
        head.load_state_dict(saved["head"])
        optimiser.load_state_dict(saved["optimiser"])
        gen.set_state(saved["rng"])
        state = {k: saved[k] for k in state}
    head.train()
    started = time.perf_counter() - state["wall_s"]
    with progress(total=config.steps, initial=state["step"], desc="train", unit="step", enabled=True) as bar:
        while state["step"] < config.steps:
            step = state["step"]
            picks = [windows[int(i)] for i in torch.randint(len(windows), (config.batch,), generator=gen)]
            batch = _batch(sequences, picks, config.window, vocab_index, config.device)
            for group in optimiser.param_groups:
                group["lr"] = _lr(config, step)
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
                _save_checkpoint(out / CHECKPOINT, head, optimiser, gen, state)
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
    if (out / DATA).exists():
        data = torch.load(out / DATA, weights_only=False)
        if {k: data["config"][k] for k in DATA_FIELDS} != {k: getattr(config, k) for k in DATA_FIELDS}:
            raise ConfigError(f"{out} holds data made with other options; use another --out or the same options.")
    else:
        started = time.perf_counter()
        data = collect_data(model, tokenizer, config)
        data |= {"config": asdict(config), "generate_wall_s": round(time.perf_counter() - started, 1)}
        torch.save(data, out / DATA)
    return model, data


def run_training(shards: str | Path, out: str | Path, config: TrainConfig = TrainConfig()) -> dict:
    """Train a draft head for the model in `shards` (OUT/local + OUT/cloud) into `out`; returns the manifest."""
    shards, out = Path(shards), Path(out)
    if not (shards / "local").is_dir() or not (shards / "cloud").is_dir():
        raise ConfigError(f"{shards} is not a prepared shards directory (OUT/local + OUT/cloud); run `splitinfer prepare`.")
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)
    model, data = load_or_collect(shards, config, out)
    vocab = model.config.vocab_size
    draft_vocab = draft_vocabulary(data["sequences"], config.draft_vocab_size, vocab)
    vocab_index = torch.full((vocab,), -100, dtype=torch.long)
    vocab_index[draft_vocab] = torch.arange(len(draft_vocab))
    torch.manual_seed(config.seed)
    head_config = DraftHeadConfig.for_model(model.config, config.draft_vocab_size, config.intermediate_size)
    head = DraftHead(head_config, model.model.embed_tokens, model.model.norm, model.lm_head, draft_vocab.to(config.device),
                     getattr(model.config, "final_logit_softcapping", None)).to(config.device)
    state = train_head(head, data, config, out, vocab_index)
    fingerprint = model_identity(read_manifest(shards / "local", "local"))
    head.save(out, extra={"model_fingerprint": fingerprint})
    manifest = {
        "model_fingerprint": fingerprint,
        "data_sha256": data["sha256"],
        "generated_tokens": data["generated_tokens"],
        "training_pairs": sum(len(s["tokens"]) - 2 for s in data["sequences"]),
        "prompts": data["prompts"],
        "seed": config.seed,
        "steps": state["step"],
        "generate_wall_s": data["generate_wall_s"],
        "train_wall_s": round(state["wall_s"], 1),
        "losses": _loss_summary(state["losses"]),
        "config": asdict(config),
        "head": asdict(head_config),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest
