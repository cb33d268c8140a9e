"""The decoding loop shared by every strategy: propose, verify in one round trip, accept, commit.

    root = choose(prefill logits)                       # emitted
    repeat:
        draft = strategy.propose(history)              # nodes below the root
        logits = session.run_block([root] + draft)     # one round trip
        path, next = accept(block, logits, choose)     # rows whose tokens the model itself chose
        session.commit(path)                           # local now, cloud with the next request
        emit(accepted drafts..., next); root = next

With `choose = argmax` the emitted tokens are exactly those of sequential greedy decoding. Each emitted
token's log-probability comes from the logits row that predicted it: the parent's row.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ..local.session import SplitSession
from ..masks import BlockStructure
from .draft import accept, block_layout
from .sampling import greedy
from .strategies import Strategy


def decode(
    session: SplitSession,
    prompt: list[int],
    prompt_logits: torch.Tensor,
    max_new_tokens: int,
    stop_ids: set[int],
    emit: Callable[[int, float], None],
    strategy: Strategy,
    choose: Callable[[torch.Tensor], int] = greedy,
) -> str:
    """Decode after prefill; `emit(token, logprob)` per token. Returns "stop" or "length".

    prompt_logits: [r, vocab] logits of the prompt's last r rows (r >= 1; the strategy asked for r).
    """
    strategy.start(prompt, prompt_logits)
    first_logits = prompt_logits[-1]
    history = list(prompt)
    produced = 0

    def emit_all(tokens: list[int], rows: list[torch.Tensor]) -> str | None:
        nonlocal produced
        for token, row in zip(tokens, rows):
            emit(token, float(torch.log_softmax(row, dim=-1)[token]))
            history.append(token)
            produced += 1
            if token in stop_ids:
                return "stop"
            if produced == max_new_tokens:
                return "length"
        return None

    root = choose(first_logits)
    finish = emit_all([root], [first_logits])
    while finish is None:
        t0 = time.perf_counter()
        draft = strategy.propose(history)
        tokens, parents = draft.block(root)
        if draft.side is not None and draft.side.tokens:
            allowed, depths = block_layout(parents, draft.side)
            block = tokens + draft.side.tokens
            logits = session.run_block(block, BlockStructure.matrix(allowed), depths=depths)  # [t + r, vocab]
        else:
            structure = BlockStructure.tree(parents) if len(tokens) > 1 else BlockStructure.chain()
            logits = session.run_block(tokens, structure)  # [q, vocab]
        path, root = accept(tokens, parents, logits[: len(tokens)], choose)
        session.commit(path)
        session.records[-1].accepted = len(path)
        emitted = [tokens[r] for r in path[1:]] + [root]
        # A token is predicted by its parent's row: path[i] by path[i-1], the next root by path[-1].
        finish = emit_all(emitted, [logits[r] for r in path])
        strategy.observe(tokens, parents, logits, path, emitted, (time.perf_counter() - t0) * 1e3)
    return finish
