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


def target_probs(row: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """[vocab] logits -> [vocab] float32 probabilities of the sampling distribution."""
    logits = row.float() / config.temperature
    if config.top_k and config.top_k < logits.shape[-1]:
        kth = torch.topk(logits, config.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if config.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # keep a token if the mass before it is still below top_p (the first token is always kept)
        drop = (torch.cumsum(sorted_probs, 0) - sorted_probs) >= config.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        probs = probs / probs.sum()
    return probs


def make_chooser(config: SamplingConfig | None) -> Callable[[torch.Tensor], int]:
    if config is None or config.temperature == 0:
        return greedy
    generator = torch.Generator()
    generator.manual_seed(config.seed if config.seed is not None else torch.seed())

    def sample(row: torch.Tensor) -> int:
        return int(torch.multinomial(target_probs(row, config), 1, generator=generator))

    return sample
