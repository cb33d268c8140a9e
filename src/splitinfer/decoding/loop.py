"""The decoding loop shared by every strategy: propose, verify in one round trip, accept, commit.

    root = choose(prefill logits)                       # emitted
    repeat:
        block = strategy.propose(history).to_block(root)   # the root, the draft below it, any side rows
        logits = verifier.run_block(block)                  # one round trip
        path, next = accept(block, logits, choose)          # rows whose tokens the model itself chose
        verifier.commit(path)                               # local now, cloud with the next request
        emit(accepted drafts..., next); root = next

With `choose = argmax` the emitted tokens are exactly those of sequential greedy decoding. Each emitted
token's log-probability comes from the logits row that predicted it: the parent's row.

A verifier that may keep several blocks in flight (`in_flight` > 1, the split session with a v3 server)
decodes through pipeline.py instead, with the same acceptance and the same output; strategies that read
the final features (a learned draft head) need each block's features before drafting the next, so they go
one block at a time.

The loop knows the verifier only through its Protocol (verifier.py) and a strategy only through
propose/observe and the block its draft lays out; it keeps no telemetry (the verifier records its steps).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from .draft import accept
from .pipeline import decode_in_flight
from .sampling import greedy
from .strategies import Strategy
from .verifier import Verifier


def decode(
    verifier: Verifier,
    prompt: list[int],
    prompt_logits: torch.Tensor,
    max_new_tokens: int,
    stop_ids: set[int],
    emit: Callable[[int, float], bool | None],
    strategy: Strategy,
    choose: Callable[[torch.Tensor], int] = greedy,
) -> str:
    """Decode after prefill; `emit(token, logprob)` per token. Returns "stop" or "length".

    emit returns True to end decoding after that token ("stop": e.g. its text completed a stop string).

    prompt_logits: [r, vocab] logits of the prompt's last r rows (r >= 1; the strategy asked for r).
    """
    strategy.start(prompt, prompt_logits)
    if strategy.uses_features:
        strategy.see_features(verifier.features())
    first_logits = prompt_logits[-1]
    history = list(prompt)
    produced = 0

    def emit_all(tokens: list[int], rows: list[torch.Tensor]) -> str | None:
        nonlocal produced
        for token, row in zip(tokens, rows):
            ended = emit(token, float(torch.log_softmax(row, dim=-1)[token]))
            history.append(token)
            produced += 1
            if ended or token in stop_ids:
                return "stop"
            if produced == max_new_tokens:
                return "length"
        return None

    root = choose(first_logits)
    finish = emit_all([root], [first_logits])
    depth = getattr(verifier, "in_flight", 1)
    if finish is None and depth > 1 and not strategy.uses_features:
        return decode_in_flight(verifier, history, root, emit_all, strategy, choose, depth)
    while finish is None:
        t0 = time.perf_counter()
        block = strategy.propose(history).to_block(root)
        logits = verifier.run_block(block.tokens, block.structure, depths=block.depths)  # [tree + side rows, vocab]
        tokens, parents = block.tree_tokens, block.parents
        path, root = accept(tokens, parents, logits[: len(tokens)], choose)
        verifier.commit(path)
        if strategy.uses_features:
            strategy.see_features(verifier.features())
        emitted = [tokens[r] for r in path[1:]] + [root]
        # A token is predicted by its parent's row: path[i] by path[i-1], the next root by path[-1].
        finish = emit_all(emitted, [logits[r] for r in path])
        strategy.observe(tokens, parents, logits, path, emitted, (time.perf_counter() - t0) * 1e3)
    return finish
