"""Token choice rules: greedy, and sampling with temperature, top-k, top-p and a seed.

Speculation stays exact under sampling because acceptance draws at each tree node from the model's own
(tempered, truncated) distribution and follows a child only when the draw equals it (draft.accept).
Every emitted token costs exactly one draw, as in sequential sampling, so with the same seed and
bit-identical logits a speculative run reproduces the sequential run token for token.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import ConfigError


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 1.0  # > 0; 0 means greedy
    top_k: int = 0  # keep the k most likely tokens; 0 keeps all
    top_p: float = 1.0  # keep the smallest set whose probability reaches top_p
    seed: int | None = None  # for reproducible runs

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ConfigError("--temperature must be a finite number >= 0 (0 means greedy).")
        if self.top_k < 0:
            raise ConfigError("--top-k must be >= 0 (0 disables it).")
        if not 0 < self.top_p <= 1:
            raise ConfigError("--top-p must be in (0, 1].")


def greedy(row: torch.Tensor) -> int:
    return int(torch.argmax(row))


def truncated(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The one top-k, top-p rule: logits [..., vocab] -> (weights [..., k], ids [..., k]) over the k most
    likely tokens in descending order (top_k 0: the whole vocabulary). The sort runs over k entries, not
    the vocabulary. Weights are not renormalised after the top-p cut (torch.multinomial takes weights)."""
    k = top_k if 0 < top_k < logits.shape[-1] else logits.shape[-1]
    top, ids = (logits.float() / temperature).topk(k, dim=-1)
    probs = top.softmax(-1)
    # Keep the smallest prefix whose mass reaches top_p: a token stays when the mass before it is < top_p.
    return probs.masked_fill(probs.cumsum(-1) - probs >= top_p, 0.0), ids


def draw(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
         generator: torch.Generator | None) -> torch.Tensor:
    """logits [B, vocab] -> [B] token ids drawn by `truncated`'s rule."""
    weights, ids = truncated(logits, temperature, top_k, top_p)
    pick = torch.multinomial(weights.cpu(), 1, generator=generator).to(ids.device)  # [B, 1]
    return ids.gather(-1, pick)[:, 0]


def target_probs(row: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """[vocab] logits -> [vocab] float32 probabilities of the sampling distribution (`truncated`'s rule)."""
    if not config.top_k and config.top_p >= 1.0:
        return torch.softmax(row.float() / config.temperature, dim=-1)
    weights, ids = truncated(row, config.temperature, config.top_k, config.top_p)
    probs = torch.zeros(row.shape[-1], dtype=torch.float32, device=row.device).scatter_(0, ids, weights)
    return probs / probs.sum()


def make_chooser(config: SamplingConfig | None) -> Callable[[torch.Tensor], int]:
    if config is None or config.temperature == 0:
        return greedy
    generator = torch.Generator()
    generator.manual_seed(config.seed if config.seed is not None else torch.seed())

    def sample(row: torch.Tensor) -> int:
        return int(torch.multinomial(target_probs(row, config), 1, generator=generator))

    return sample
