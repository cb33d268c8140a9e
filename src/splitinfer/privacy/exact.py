"""A4, known-weights exact matching: re-run the local layers on candidate tokens and match the activation.

Input side: a hidden state after k layers is a deterministic function of the token and its prefix. Given
the prefix it has already recovered, the attacker runs the public layers [0, k) on a block of candidate
tokens at the next position (each candidate sees the cached prefix and itself only, the same masked-block
machinery the speculative verifier uses), and takes the candidate whose output is closest to what it saw.
Candidates come in the pruner's order (a learned attacker's top guesses, then the whole vocabulary ranked
by cosine to a known-weights codebook: every token run through the layers once after a one-token prefix),
in growing blocks, and the search stops at the first candidate within `tolerance`: with the true weights
the right token matches to float16 rounding, every other token is far away. The plain embedding is no
pruner here: on SmolLM2 the nearest embedding ranks the right token ~15,000th already after one layer.

Output side: the cloud holds the hidden states entering the last m layers; with the public tail, norm and
LM head it computes the client's logits itself (no search needed).

This module knows the layer stack and nothing about corpora or statistics.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..masks import chain_allowed
from ..model.stack import LayerStack

TOPK = 5


@dataclass(frozen=True)
class ExactConfig:
    tolerance: float = 1e-2  # relative L2 distance accepted as a match (float16 wire rounding is ~1e-3)
    blocks: tuple[int, ...] = (8, 56, 448, 2048)  # candidates per forward; the last size repeats
    max_candidates: int = 1 << 20  # per position; below the vocabulary size the scan is partial


@dataclass
class ExactStats:
    positions: int = 0
    candidates_run: int = 0  # candidate tokens pushed through the layers, in total
    past_first_block: int = 0  # positions where the search went past the first block
    unmatched: int = 0  # positions where no candidate came within tolerance (best guess kept)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def head_stack(model: nn.Module, k: int) -> LayerStack:
    """Layers [0, k) of a whole HF model as a LayerStack (copies: the stack renumbers its layers)."""
    layers = [copy.deepcopy(layer) for layer in model.model.layers[:k]]
    return LayerStack(model.config, layers, 0, model.model.rotary_emb)


def tail_stack(model: nn.Module, m: int) -> LayerStack:
    n = len(model.model.layers)
    layers = [copy.deepcopy(layer) for layer in model.model.layers[n - m :]]
    return LayerStack(model.config, layers, n - m, model.model.rotary_emb)


@torch.inference_mode()
def codebooks(model: nn.Module, depths: tuple[int, ...], prefix: list[int], block: int = 2048) -> dict[int, torch.Tensor]:
    """{k: [V, d] float16}: each token's hidden state after k layers, at the position after `prefix`.

    One pass through max(depths) layers serves every depth. Costs V * max(depths) token-layers.
    """
    stack = head_stack(model, max(depths))
    embed, vocab, p = model.model.embed_tokens, model.config.vocab_size, len(prefix)
    prefix_cache = stack.new_cache()
    stack(embed(torch.tensor(prefix))[None], torch.arange(p), np.tril(np.ones((p, p), dtype=bool)), prefix_cache)
    prefix_cache.commit_all()
    books: dict[int, list] = {k: [] for k in depths}
    for start in range(0, vocab, block):
        ids = torch.arange(start, min(vocab, start + block))
        q = len(ids)
        hidden = embed(ids)[None]
        positions = torch.full((q,), p, dtype=torch.long)
        for k in range(1, max(depths) + 1):
            sub = LayerStack(model.config, [stack.layers[k - 1]], 0, stack.rotary)
            sub.layers[0].self_attn.layer_idx = k - 1  # LayerStack renumbered it to 0; this cache is by depth
            hidden = sub(hidden, positions, np.eye(q, dtype=bool), prefix_cache)
            if k in depths:
                books[k].append(hidden[0].to(torch.float16))
        prefix_cache.truncate(prefix_cache.length)
    return {k: torch.cat(v) for k, v in books.items()}


def _order(guesses: np.ndarray, scores: torch.Tensor, lead: int = 4) -> torch.Tensor:
    """Candidate order: the codebook's `lead` best, the learned pruners' guesses, then the rest of the
    vocabulary by descending codebook similarity."""
    ranked = scores.argsort(descending=True)
    first = _dedupe(torch.cat([ranked[:lead], torch.as_tensor(guesses, dtype=torch.long).reshape(-1)]))
    rest = ranked[~torch.isin(ranked, first)]
    return torch.cat([first, rest])


def _dedupe(ids: torch.Tensor) -> torch.Tensor:
    seen, keep = set(), []
    for i in ids.tolist():
        if i not in seen:
            seen.add(i)
            keep.append(i)
    return torch.tensor(keep, dtype=torch.long)


@torch.inference_mode()
def match_chunk(
    stack: LayerStack,
    embed: nn.Module,
    codebook: torch.Tensor,
    observed: np.ndarray,
    guesses: np.ndarray,
    config: ExactConfig,
    stats: ExactStats,
) -> np.ndarray:
    """observed: [L, d] hidden states after the stack; codebook: [V, d] (see `codebooks`); guesses: [L, g]
    pruner guesses -> [L, 5] ranked ids."""
    started = time.perf_counter()
    e_norm = torch.nn.functional.normalize(codebook.float(), dim=-1)
    obs = torch.from_numpy(observed).float()
    cache = stack.new_cache()
    out = np.zeros((len(obs), TOPK), dtype=np.int64)
    for t in range(len(obs)):
        target = obs[t]
        scale = target.norm().clamp_min(1e-6)
        order = _order(guesses[t], torch.nn.functional.normalize(target, dim=-1) @ e_norm.T)
        order = order[: config.max_candidates]
        tried_ids, tried_dist = [], []
        start, block, chosen_row = 0, 0, None
        while start < len(order):
            size = config.blocks[min(block, len(config.blocks) - 1)]
            cands = order[start : start + size]
            q = len(cands)
            hidden = embed(cands)[None]  # [1, q, d]
            positions = torch.full((q,), t, dtype=torch.long)
            result = stack(hidden, positions, np.eye(q, dtype=bool), cache)[0]  # [q, d]
            dist = (result.float() - target).norm(dim=-1) / scale
            stats.candidates_run += q
            tried_ids.append(cands)
            tried_dist.append(dist)
            best = int(dist.argmin())
            if float(dist[best]) < config.tolerance:
                chosen_row = best
                break
            cache.truncate(cache.length)  # drop the pending block
            start, block = start + q, block + 1
            if block == 1:
                stats.past_first_block += 1
        ids, dists = torch.cat(tried_ids), torch.cat(tried_dist)
        top = dists.topk(min(TOPK, len(dists)), largest=False).indices
        out[t, : len(top)] = ids[top].numpy()
        if chosen_row is not None:
            cache.keep([chosen_row])
        else:
            stats.unmatched += 1
            cache.truncate(cache.length)
            stack(embed(ids[top[:1]])[None], torch.tensor([t]), np.ones((1, 1), dtype=bool), cache)
            cache.commit_all()
        stats.positions += 1
    stats.seconds += time.perf_counter() - started
    return out


@torch.inference_mode()
def lens_through_tail(stack: LayerStack, norm: nn.Module, lm_head: nn.Module, observed: np.ndarray) -> np.ndarray:
    """Output side: run the public tail on a chunk's returned states [L, d] -> [L, 5] ranked ids."""
    hidden = torch.from_numpy(observed).float()[None]
    positions = torch.arange(hidden.shape[1])
    result = stack(hidden, positions, chain_allowed(hidden.shape[1]), stack.new_cache())
    return lm_head(norm(result[0])).topk(TOPK, dim=-1).indices.numpy()
