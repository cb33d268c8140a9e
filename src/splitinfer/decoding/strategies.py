"""Decoding strategies: each proposes a draft below the root token and learns from every verified block.

    sequential  no draft: one token per round trip (the reference)
    jacobi      a chain of guesses refined by iteration (the paper's negative result, kept for comparison)
    lookahead   the paper's method: n-grams from a single-token-keyed pool, G candidates of N-1 tokens
    tree        the default: a suffix index and Token Recycling merged into one tree, ranked by estimated
                path probability and sized each step by the measured cost model (controller.py)

A strategy never checks its own draft; `draft.accept` does, identically for all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .controller import BlockController, ControllerConfig
from .draft import Draft, TokenTrie
from .sources import NgramPool, SuffixIndex, TokenRecycling


class Strategy:
    name = "base"

    def start(self, prompt: list[int]) -> None:
        """Called once per generation with the prompt ids."""

    def propose(self, history: list[int]) -> Draft:
        """history: prompt + emitted tokens; its last token is the root of the next block."""
        return Draft()

    def observe(self, tokens: list[int], parents: list[int], logits: torch.Tensor, path: list[int], emitted: list[int], step_ms: float) -> None:
        """After a verified block: its tokens and parents, logits [q, vocab], the accepted rows, the
        tokens emitted by this step (accepted drafts + the next root) and the step's wall time."""


class Sequential(Strategy):
    name = "sequential"


@dataclass(frozen=True)
class JacobiConfig:
    window: int = 8  # block rows: the root plus window-1 guesses


class Jacobi(Strategy):
    """Plain Jacobi iteration: guesses for the next positions are the previous iteration's predictions."""

    name = "jacobi"

    def __init__(self, config: JacobiConfig = JacobiConfig()):
        self.config = config
        self._guesses: list[int] = []

    def start(self, prompt):
        self._guesses = []

    def propose(self, history):
        want = self.config.window - 1
        guesses = (self._guesses or [history[-1]])[:want]
        guesses = guesses + [guesses[-1]] * (want - len(guesses))
        return Draft(tokens=guesses, parents=list(range(len(guesses))), scores=[0.0] * len(guesses))

    def observe(self, tokens, parents, logits, path, emitted, step_ms):
        predictions = logits.argmax(dim=-1).tolist()
        self._guesses = predictions[path[-1] + 1 :]


@dataclass(frozen=True)
class LookaheadConfig:
    ngram: int = 5  # N: n-gram size (a candidate is N-1 tokens after the root)
    candidates: int = 5  # G: candidates verified per step


class Lookahead(Strategy):
    """The original paper's n-gram lookahead (prompt and output n-grams keyed on the root token)."""

    name = "lookahead"

    def __init__(self, config: LookaheadConfig = LookaheadConfig()):
        self.config = config

    def start(self, prompt):
        self.pool = NgramPool(self.config.ngram, self.config.candidates)
        self.pool.extend(prompt)

    def propose(self, history):
        trie = TokenTrie()
        self.pool.propose(history[-1], trie)
        return trie.best(len(trie))

    def observe(self, tokens, parents, logits, path, emitted, step_ms):
        self.pool.extend(emitted)


@dataclass(frozen=True)
class TreeConfig:
    max_depth: int = 12  # deepest draft node
    recycling_k: int = 8  # successors kept per token
    recycling_nodes: int = 48  # candidate nodes expanded from the successor table per step
    max_match: int = 8  # longest suffix looked up in the index
    fixed_nodes: int | None = None  # verify exactly this many nodes per step (no cost model): for studies
    controller: ControllerConfig = ControllerConfig()


class Tree(Strategy):
    """Suffix index + Token Recycling, merged into one tree and sized by the measured cost model."""

    name = "tree"

    def __init__(self, config: TreeConfig = TreeConfig(), earlier: list[list[int]] | None = None):
        self.config = config
        self.recycling = TokenRecycling(config.recycling_k)  # kept across generations: it is model knowledge
        self.controller = BlockController(config.controller)
        self.earlier = earlier if earlier is not None else []
        self.last_draft = Draft()

    def start(self, prompt):
        self.index = SuffixIndex(self.config.max_match)
        for doc in self.earlier:
            self.index.add_doc(doc)
        self.doc = self.index.add_doc(prompt)

    def propose(self, history):
        trie = TokenTrie()
        self.index.propose(history, trie, self.config.max_depth)
        self.recycling.propose(history[-1], trie, self.config.recycling_nodes, self.config.max_depth)
        scores = sorted(trie.score[1:], reverse=True)
        n = self.config.fixed_nodes if self.config.fixed_nodes is not None else self.controller.choose(scores)
        self.last_draft = trie.best(n)
        return self.last_draft

    def observe(self, tokens, parents, logits, path, emitted, step_ms):
        self.recycling.observe(tokens, logits)
        self.index.extend(self.doc, emitted)
        predicted = sum(self.last_draft.scores)
        self.controller.observe(len(tokens), step_ms, predicted, len(path) - 1)


STRATEGIES = {"sequential": Sequential, "jacobi": Jacobi, "lookahead": Lookahead, "tree": Tree}


def make_strategy(name: str, **kwargs) -> Strategy:
    return STRATEGIES[name](**kwargs)
