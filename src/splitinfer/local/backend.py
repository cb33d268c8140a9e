"""What a conversation needs from the client that made it, as one small frozen object.

`Backend` sits below both local/client.py (which builds one per conversation) and local/conversation.py
(which only reads it), so neither imports the other's module for its types. It holds the local half, how
to open a session, how to make a strategy from a name, the end-of-sequence ids and a label for the stats.
It also gives the two facts of the model that the generation path needs (`stop_ids_of`, `context_limit_of`),
read from its config through hfconfig.py, the one reader of a config's optional fields.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..decoding.strategies import Strategy
from ..decoding.warm import SuffixMemory
from ..hfconfig import context_limit, eos_ids
from ..model.shards import LocalHalf
from .session import SplitSession


@dataclass(frozen=True)
class Backend:
    local: LocalHalf  # the trusted half: tokenizer, embedding, head and tail layers, LM head
    open_session: Callable[[], SplitSession]  # a new split session (its own cloud session) over a new middle
    make_strategy: Callable[[str, SuffixMemory | None], Strategy]  # a fresh strategy by name, drafting from memory
    stop_ids: frozenset[int]  # the model's end-of-sequence ids: a reply ends at one unless told otherwise
    label: str  # "split" (a cloud server) or "local-only" (the middle in this process): the stats' `mode`


def stop_ids_of(local: LocalHalf) -> frozenset[int]:
    """The end-of-sequence ids of the model config and the tokenizer (either may have none)."""
    tokenizer_eos = local.tokenizer.eos_token_id if local.tokenizer is not None else None
    return eos_ids(local.config) | (frozenset((tokenizer_eos,)) if isinstance(tokenizer_eos, int) else frozenset())


def context_limit_of(local: LocalHalf) -> int | None:
    """The model's context in tokens, or None where its config names none (not every architecture does)."""
    return context_limit(local.config)
