"""Training the draft head: its losses and the resumable training loop.

The head is unrolled `depth` passes on its own predictions (drafter/unroll.py); each pass's loss is SmoothL1
to the true next feature (scaled by the data's feature spread) + `ce_weight` x cross-entropy against the
model's own distribution over the draft vocabulary at that feature. Pass 0's input features get a little
uniform noise. Training windows cover each reply and the end of its prompt. checkpoint.pt is written every
`checkpoint_every` steps (head, optimiser, RNG state, loss curves, wall time, the learning-rate schedule);
checkpoint-stable.pt, the last one before the schedule's decay, is what a run extended with a larger
--steps resumes from (drafter/schedule.py). The held-out loss is recorded at each checkpoint.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..model.drafthead import DraftHead
from ..progress import progress
from . import schedule
from .config import TrainConfig
from .data import split_heldout
from .schedule import Schedule
from .unroll import path_tokens, path_valid, soft_cross_entropy, unroll, window_tensors


def draft_vocabulary(sequences: list[dict], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent token ids in the data (ties by id), topped up with the lowest unseen ids."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in sequences:
        tokens = torch.as_tensor(s["tokens"], dtype=torch.long)
        tokens = tokens[s["draft"]] if "draft" in s else tokens  # teacher-forced: assistant text only
        counts += torch.bincount(tokens, minlength=vocab_size)[:vocab_size]
    order = sorted(range(vocab_size), key=lambda i: (-int(counts[i]), i))
    return torch.tensor(order[:size], dtype=torch.long)


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
