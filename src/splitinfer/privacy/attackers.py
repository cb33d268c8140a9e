"""Learned and lookup attackers: hidden states the cloud saw -> ranked guesses of the token behind each.

A1  input side: nearest row of the public embedding by cosine; output side: the logit lens (public final
    norm + LM head applied to the returned hidden state). Needs no training; ranks the whole vocabulary.
A2  the original paper's attacker: a 3-layer MLP on one activation, trained on the attacker's own text.
A3  a sequence-aware attacker: a small bidirectional transformer over a chunk's whole hidden-state sequence.

Learned attackers only predict token types present in their training targets; the audit's ceiling is the
share of test tokens whose type is among them. Features are standardised with training statistics, since
a few dimensions (and position 0) carry activations hundreds of times larger than the rest.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..progress import progress

TOPK = 5


@dataclass(frozen=True)
class TrainConfig:
    hidden: int = 256  # width of the MLP / transformer
    epochs: int = 6  # passes over the training rows
    max_seconds: float = 120.0  # safety cap per attacker; hitting it is recorded in the results
    batch_rows: int = 256  # A2 rows per step
    batch_chunks: int = 16  # A3 chunks per step
    lr: float = 2e-3
    seed: int = 0


@dataclass
class Fitted:
    """A trained attacker and what the audit records about its training."""

    model: nn.Module
    classes: np.ndarray  # [C] vocab ids the attacker can output
    mean: torch.Tensor  # [d]
    std: torch.Tensor  # [d]
    seconds: float
    epochs_run: int
    capped: bool


def embedding_topk(embed: torch.Tensor, x: np.ndarray, k: int = TOPK, block: int = 1024) -> np.ndarray:
    """A1 input side: [T, d] hidden -> [T, k] vocab ids of the nearest embedding rows by cosine."""
    e = torch.nn.functional.normalize(embed.float(), dim=-1)
    out = []
    for start in range(0, len(x), block):
        h = torch.nn.functional.normalize(torch.from_numpy(x[start : start + block]).float(), dim=-1)
        out.append((h @ e.T).topk(k, dim=-1).indices)
    return torch.cat(out).numpy()


def lens_topk(norm: nn.Module, lm_head: nn.Module, x: np.ndarray, k: int = TOPK, block: int = 1024) -> np.ndarray:
    """A1 output side: [T, d] hidden -> [T, k] vocab ids by the logit lens."""
    out = []
    with torch.inference_mode():
        for start in range(0, len(x), block):
            h = torch.from_numpy(x[start : start + block]).float()
            out.append(lm_head(norm(h)).topk(k, dim=-1).indices)
    return torch.cat(out).numpy()


class _MLP(nn.Module):
    def __init__(self, d: int, hidden: int, classes: int):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, classes)
        )

    def forward(self, x):  # x: [B, d] or [B, L, d]
        return self.net(x)


class _SeqAttacker(nn.Module):
    """Bidirectional encoder: every position sees the chunk's whole hidden-state sequence."""

    def __init__(self, d: int, hidden: int, classes: int, max_len: int = 512):
        super().__init__()
        self.inp = nn.Linear(d, hidden)
        self.pos = nn.Embedding(max_len, hidden)
        layer = nn.TransformerEncoderLayer(hidden, 4, 2 * hidden, dropout=0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.out = nn.Linear(hidden, classes)

    def forward(self, x, pad):  # x: [B, L, d]; pad: [B, L] True where padding
        positions = torch.arange(x.shape[1], device=x.device)
        h = self.inp(x) + self.pos(positions)[None]
        return self.out(self.encoder(h, src_key_padding_mask=pad))


def _prepare(x: np.ndarray, y: np.ndarray):
    classes, y_idx = np.unique(y, return_inverse=True)
    xt = torch.from_numpy(x).float()
    mean, std = xt.mean(0), xt.std(0) + 1e-3
    return classes, torch.from_numpy(y_idx).long(), (xt - mean) / std, mean, std


def _chunks(bounds: list[tuple[int, int]], xs: torch.Tensor, ys: torch.Tensor | None, idx: list[int]):
    """Pad the chunks `idx` into [B, L, d] features, [B, L] targets (-100 = padding) and a pad mask."""
    length = max(bounds[i][1] - bounds[i][0] for i in idx)
    x = xs.new_zeros(len(idx), length, xs.shape[1])
    y = torch.full((len(idx), length), -100, dtype=torch.long)
    pad = torch.ones(len(idx), length, dtype=torch.bool)
    for row, i in enumerate(idx):
        s, e = bounds[i]
        x[row, : e - s] = xs[s:e]
        pad[row, : e - s] = False
        if ys is not None:
            y[row, : e - s] = ys[s:e]
    return x, y, pad


def fit(kind: str, x: np.ndarray, y: np.ndarray, bounds: list[tuple[int, int]], config: TrainConfig) -> Fitted:
    """Train A2 ("mlp") on rows or A3 ("seq") on chunks (`bounds`: [start, end) rows per chunk)."""
    torch.manual_seed(config.seed)
    rng = np.random.default_rng(config.seed)
    classes, ys, xs, mean, std = _prepare(x, y)
    d = xs.shape[1]
    model = _MLP(d, config.hidden, len(classes)) if kind == "mlp" else _SeqAttacker(d, config.hidden, len(classes))
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.01)
    loss_fn = nn.CrossEntropyLoss(ignore_index=-100)
    units = len(xs) if kind == "mlp" else len(bounds)
    batch = config.batch_rows if kind == "mlp" else config.batch_chunks
    steps_total = config.epochs * math.ceil(units / batch)
    # OneCycleLR divides by zero below ~20 total steps (tiny chosen-plaintext sets); padding the schedule is harmless.
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, config.lr, total_steps=max(steps_total, 20), pct_start=0.1)
    start, epochs_run, capped = time.perf_counter(), 0, False
    model.train()
    bar = progress(total=steps_total, desc=f"train {kind}", unit="step")
    for _epoch in range(config.epochs):
        order = rng.permutation(units)
        for s in range(0, units, batch):
            idx = order[s : s + batch]
            if kind == "mlp":
                loss = loss_fn(model(xs[idx]), ys[idx])
            else:
                xb, yb, pad = _chunks(bounds, xs, ys, idx.tolist())
                loss = loss_fn(model(xb, pad).flatten(0, 1), yb.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            bar.update(1)
            if time.perf_counter() - start > config.max_seconds:
                capped = True
                break
        epochs_run += 1
        if capped:
            break
    bar.close()
    model.eval()
    return Fitted(model, classes, mean, std, time.perf_counter() - start, epochs_run, capped)


def predict(fitted: Fitted, x: np.ndarray, bounds: list[tuple[int, int]], k: int = TOPK) -> np.ndarray:
    """[T, d] hidden -> [T, k] vocab ids."""
    xs = (torch.from_numpy(x).float() - fitted.mean) / fitted.std
    k = min(k, len(fitted.classes))
    out = np.zeros((len(x), k), dtype=np.int64)
    with torch.inference_mode():
        if isinstance(fitted.model, _MLP):
            for s in range(0, len(xs), 4096):
                top = fitted.model(xs[s : s + 4096]).topk(k, dim=-1).indices.numpy()
                out[s : s + 4096] = fitted.classes[top]
        else:
            for s in range(0, len(bounds), 32):
                idx = list(range(s, min(s + 32, len(bounds))))
                xb, _, pad = _chunks(bounds, xs, None, idx)
                top = fitted.model(xb, pad).topk(k, dim=-1).indices.numpy()
                for row, i in enumerate(idx):
                    a, b = bounds[i]
                    out[a:b] = fitted.classes[top[row, : b - a]]
    return out
