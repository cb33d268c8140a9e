"""Batched continuations of many prompts by the whole model, with the final features of every row: the
drafter's training data (drafter/train.py). Knows nothing of splitting, the wire or the head.

Profiled on a CPU (32 prompts, sampled), HF `generate` spent about a third of its time growing every
layer's cache by concatenation each step, top-p sorting the whole 49k vocabulary for every row, and drawing
over the whole vocabulary. This loop writes keys and values in place into
a `StaticCache` sized for the whole batch, and draws sampled tokens by top-p within the `top_k` most likely
tokens, so the sort runs over k entries, not the vocabulary.

Prompts are left-padded to one width; each row's positions count its real tokens only, and the padding is
masked, so a row's continuation is its own whatever the batch. A row stops at its first end-of-sequence
token; the batch stops when every row has stopped or after `max_new_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..decoding.sampling import draw
from ..model.stack import cache_keyword


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.8
    top_p: float = 0.95  # nucleus mass, taken among the top_k most likely tokens
    top_k: int = 64  # candidates per draw: beyond them the mass is negligible at this temperature


def next_tokens(logits: torch.Tensor, sampling: Sampling | None, gen: torch.Generator | None) -> torch.Tensor:
    """logits [B, vocab] -> token ids [B]: the argmax (greedy, `sampling` None) or a top-k, top-p draw."""
    if sampling is None:
        return logits.argmax(-1)
    return draw(logits, sampling.temperature, sampling.top_k, sampling.top_p, gen)


def _capture_features(model) -> tuple[list, object]:
    """Collect the input of the final norm (pre-norm final features) on every forward call."""
    seen: list[torch.Tensor] = []
    handle = model.model.norm.register_forward_hook(lambda mod, args, out: seen.append(args[0].detach().float()))
    return seen, handle


def capture_states(model, layers: tuple[int, ...]) -> tuple[list[list[torch.Tensor]], list]:
    """Collect hidden states `layers` (HF numbering: i = the output of decoder layer i - 1) on every
    forward call: (one list per layer, the hooks to remove)."""
    seen: list[list[torch.Tensor]] = [[] for _ in layers]

    def hook(k):
        return lambda mod, args, out: seen[k].append((out[0] if isinstance(out, tuple) else out).detach().float())

    return seen, [model.model.layers[i - 1].register_forward_hook(hook(k)) for k, i in enumerate(layers)]


def fused_rows(seen: list[list[torch.Tensor]]) -> torch.Tensor | None:
    """The captured states laid side by side, [B, rows, len(layers) * d] (None when nothing is fused)."""
    return torch.cat([torch.cat(calls, dim=1) for calls in seen], dim=-1) if seen else None


@torch.inference_mode()
def generate_rows(model, prompts: list[list[int]], max_new_tokens: int, pad_id: int, eos_ids: set[int],
                  sampling: Sampling | None = None, seed: int = 0, fused_layers: tuple[int, ...] = ()) -> list[tuple]:
    """Continue every prompt -> [(prompt + continuation up to and with its end token, features
    [len(tokens) - 1, d] float16 on the CPU)] in the prompts' order; row i's feature predicts token i + 1.
    With `fused_layers`, each tuple also holds those hidden states at the same rows, [len(tokens) - 1,
    len(fused_layers) * d] float16."""
    from transformers import StaticCache

    device = model.device
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)  # [B, W]
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    total = width + max_new_tokens
    mask = torch.cat([mask, mask.new_ones(len(prompts), max_new_tokens)], dim=1)  # [B, W + new]
    positions = (mask[:, :width].cumsum(-1) - 1).clamp(min=0)  # [B, W]: padding sits at position 0
    cache = StaticCache(config=model.config, max_cache_len=total)
    gen = torch.Generator().manual_seed(seed)
    cached = {cache_keyword(model): cache}
    seen, handle = _capture_features(model)
    states, hooks = capture_states(model, fused_layers)
    generated, ended = [], torch.zeros(len(prompts), dtype=torch.bool, device=device)
    eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device)
    try:
        logits = model(input_ids=ids, attention_mask=mask[:, :width], position_ids=positions, **cached,
                       cache_position=torch.arange(width, device=device), logits_to_keep=1, use_cache=True).logits
        position = positions[:, -1:]
        for step in range(max_new_tokens):
            token = next_tokens(logits[:, -1], sampling, gen).masked_fill(ended, pad_id)  # [B]
            generated.append(token)
            ended |= torch.isin(token, eos)
            if bool(ended.all()) or step == max_new_tokens - 1:
                break
            position = position + 1
            logits = model(input_ids=token[:, None], attention_mask=mask[:, : width + step + 1], position_ids=position,
                           **cached, cache_position=torch.tensor([width + step], device=device),
                           use_cache=True).logits
    finally:
        for hook in [handle, *hooks]:
            hook.remove()
    return _rows(prompts, torch.stack(generated, dim=1).tolist(), torch.cat(seen, dim=1), width, eos_ids,
                 fused_rows(states))


def _rows(prompts: list[list[int]], generated: list[list[int]], features: torch.Tensor, width: int,
          eos_ids: set[int], fused: torch.Tensor | None = None) -> list[tuple]:
    """Cut each row at its first end token; features [B, W + steps - 1, d] (and the fused states alike) ->
    each row's own rows."""
    rows = []
    for b, prompt in enumerate(prompts):
        end = next((i + 1 for i, t in enumerate(generated[b]) if t in eos_ids), len(generated[b]))
        own = slice(width - len(prompt), width - 1 + end)
        row = (prompt + generated[b][:end], features[b, own].half().cpu())
        rows.append(row if fused is None else (*row, fused[b, own].half().cpu()))
    return rows
