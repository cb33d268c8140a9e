"""The optional fields of a HF model config, read in one place for both sides of the split.

Not every architecture's config names every field (transformers 5's base config has no eos_token_id; some
name no context length), so they are read from the config's dict; nowhere else sniffs them. It knows
nothing of the trusted side or the cloud: local/backend.py and cloud/sessions.py both read through it.
"""

from __future__ import annotations


def eos_ids(config) -> frozenset[int]:
    """The end-of-sequence ids a model config names: none, one or several."""
    source = config.to_dict().get("eos_token_id")
    if isinstance(source, int):
        return frozenset((source,))
    if isinstance(source, (list, tuple)):
        return frozenset(int(i) for i in source)
    return frozenset()


def context_limit(config) -> int | None:
    """The model's context in tokens, or None where its config names none (not every architecture does)."""
    return config.to_dict().get("max_position_embeddings")
