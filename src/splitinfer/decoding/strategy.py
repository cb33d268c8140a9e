"""What a decoding strategy is: it proposes a draft below the root token and learns from every verified
block. `Sequential` (no draft, one token per round trip) is the reference.

A strategy never checks its own draft; `draft.accept` does, identically for all of them. The strategies
themselves are in tree.py (the default) and baselines.py (kept for comparison); strategies.py names them.
"""

from __future__ import annotations

import torch

from .draft import Draft


class Strategy:
    name = "base"
    prompt_logits_rows = 1  # logits rows of the prompt's end the strategy wants at start (the LM head costs)
    uses_features = False  # True: the loop hands it the final features of the prefill and of every block
    # hidden states (HF numbering) handed with the final features, of those that cross the wire (a fused
    # draft head's extra inputs); () for the final features alone
    feature_states: tuple[int, ...] = ()
    drafts_ahead = False  # True: the loop calls `draft_ahead` while a block is on the network (uses_features)

    def see_features(self, features: torch.Tensor) -> None:
        """[q, d (1 + len(feature_states))] final features (before the final norm) of the prefill, after
        `start`, and of each block, before `observe`, then the `feature_states` of the same rows; only for
        strategies with `uses_features`."""

    def start(self, prompt: list[int], prompt_logits: torch.Tensor) -> None:
        """Called once per generation with the prompt ids and the logits of its last rows [r, vocab]."""

    def propose(self, history: list[int]) -> Draft:
        """history: prompt + emitted tokens; its last token is the root of the next block."""
        return Draft()

    def observe(self, tokens: list[int], parents: list[int], logits: torch.Tensor, path: list[int], emitted: list[int], step_ms: float) -> None:
        """After a verified block: its tokens and parents, logits [q, vocab], the accepted rows, the
        tokens emitted by this step (accepted drafts + the next root) and the step's wall time."""

    def predict(self, history: list[int], nodes: int) -> Draft:
        """Up to `nodes` guesses below history[-1], without drafting state changing: what follows a block
        still in flight (decoding/loop.py). None by default: such strategies send one block at a time."""
        return Draft()

    def draft_ahead(self, history: list[int], draft: Draft) -> None:
        """While the block with `draft` below history[-1] is on the network and the client would only wait:
        prepare the next proposal for the outcome the strategy judges likeliest, for `propose` to use if that
        outcome comes. Only for strategies with `drafts_ahead`, and only where blocks go without waiting."""

    def recall(self, draft: Draft) -> None:
        """Before `observe` with blocks in flight: the draft of the block observed (later ones were proposed
        since)."""

    def report(self) -> dict:
        """What the strategy did in this generation, for its stats; empty where there is nothing to say."""
        return {}


class Sequential(Strategy):
    name = "sequential"
