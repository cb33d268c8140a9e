"""Sequential greedy decoding: one token per round trip. The reference every other strategy must match."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..local.session import SplitSession
from ..masks import BlockStructure


def decode_sequential(
    session: SplitSession,
    first_logits: torch.Tensor,
    max_new_tokens: int,
    stop_ids: set[int],
    emit: Callable[[int, float], None],
) -> str:
    """Greedy-decode after prefill. `emit(token, logprob)` is called per token. Returns the finish reason."""
    logits = first_logits  # [vocab] float32
    for produced in range(max_new_tokens):
        token = int(torch.argmax(logits))
        emit(token, float(torch.log_softmax(logits, dim=-1)[token]))
        if token in stop_ids:
            return "stop"
        if produced + 1 == max_new_tokens:
            break
        logits = session.run_block([token], BlockStructure.chain())[0]
        session.commit([0])
        session.records[-1].accepted = 1
    return "length"
