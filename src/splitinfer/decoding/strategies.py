"""Decoding strategies: each proposes a draft below the root token and learns from every verified block.

    sequential  no draft: one token per round trip (the reference)
    jacobi      a chain of guesses refined by iteration (the paper's negative result, kept for comparison)
    lookahead   the paper's method: n-grams from a single-token-keyed pool, G candidates of N-1 tokens
    tree        the default: a suffix index and Token Recycling merged into one tree, ranked by estimated
                path probability (calibrated online from what was accepted) and sized each step by the
                measured cost model (controller.py)

A strategy never checks its own draft; `draft.accept` does, identically for all of them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from .controller import BlockController, ControllerConfig, StepCosts
from .draft import Draft, SideRows, TokenTrie
from .sources import NgramPool, SuffixIndex, TokenRecycling, prior_continue_prob


class Strategy:
    name = "base"
    prompt_logits_rows = 1  # logits rows of the prompt's end the strategy wants at start (the LM head costs)

    def start(self, prompt: list[int], prompt_logits: torch.Tensor) -> None:
        """Called once per generation with the prompt ids and the logits of its last rows [r, vocab]."""

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

    def start(self, prompt, prompt_logits):
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
    window: int = 0  # W: columns of Fu et al.'s Jacobi lookahead branch; 0 = the n-gram pool only (the paper)
    seed: int = 0  # fills new window columns with tokens drawn from the context


class Lookahead(Strategy):
    """The original paper's n-gram lookahead (prompt and output n-grams keyed on the root token).

    With `window` W > 0 it also runs the Jacobi lookahead branch of Fu et al. (2024) as side rows of
    every block: N-1 levels of W guesses, level l column j guessing the token j + 1 + l positions after
    the root and seeing the root, level 0 up to column j and the levels below it in column j (a chain of
    consecutive positions). Each step turns every column into an N-gram (its N-1 guesses plus the model's
    prediction after the top one) for the pool, drops the oldest level, adds the predictions as the newest
    and slides the window past the emitted tokens. Side rows are never accepted, so the output is unchanged.
    """

    name = "lookahead"

    def __init__(self, config: LookaheadConfig = LookaheadConfig()):
        if config.ngram < 2 or config.candidates < 0 or config.window < 0:
            raise ConfigError("lookahead needs --ngram >= 2, --candidates >= 0 and --window >= 0.")
        self.config = config

    def start(self, prompt, prompt_logits):
        self.pool = NgramPool(self.config.ngram, self.config.candidates)
        self.pool.extend(prompt)
        self._rng = random.Random(self.config.seed)
        self._context = list(prompt)
        levels, width = self.config.ngram - 1, self.config.window
        self.levels = [[self._filler() for _ in range(width)] for _ in range(levels)]
        self._tree_rows = 1

    def _filler(self) -> int:
        return self._context[self._rng.randrange(len(self._context))]

    def _side_rows(self) -> SideRows | None:
        width = self.config.window
        if width == 0:
            return None
        tokens, depths, sees = [], [], []
        for level, guesses in enumerate(self.levels):
            for col, token in enumerate(guesses):
                tokens.append(token)
                depths.append(col + 1 + level)
                sees.append(list(range(col + 1)) + [m * width + col for m in range(1, level + 1)])
        return SideRows(tokens, depths, sees)

    def propose(self, history):
        trie = TokenTrie()
        self.pool.propose(history[-1], trie)
        draft = trie.best(len(trie))
        draft.side = self._side_rows()
        self._tree_rows = len(draft) + 1
        return draft

    def observe(self, tokens, parents, logits, path, emitted, step_ms):
        self.pool.extend(emitted)
        self._context.extend(emitted)
        if self.config.window == 0:
            return
        width, levels = self.config.window, self.levels
        top = len(levels) - 1
        # predictions[l][c]: the model's token j + 2 + l positions after the old root
        predictions = logits[self._tree_rows :].argmax(dim=-1).view(len(levels), width).tolist()
        for col in range(width):
            self.pool.add([levels[m][col] for m in range(len(levels))] + [predictions[top][col]])
        # Refine along the diagonals; column 0 of each level takes the prediction one level down (or,
        # for level 0, the token chosen for offset 1 after the old root, which is exact).
        first = emitted[0]
        refined = [[first if m == 0 else predictions[m - 1][0]] for m in range(len(levels))]
        for m in range(len(levels)):
            source = levels[m + 1] if m < top else predictions[top]
            refined[m].extend(source[: width - 1])
        # Slide past the emitted tokens: the new root sits len(emitted) positions after the old one.
        shift = len(emitted)
        self.levels = [row[shift:] + [self._filler() for _ in range(min(shift, width))] for row in refined]

@dataclass(frozen=True)
class TreeConfig:
    max_depth: int = 12  # deepest Token Recycling node
    suffix_depth: int = 32  # deepest suffix-index node (a copied passage can run long)
    recycling_k: int = 8  # successors kept per token
    recycling_nodes: int = 48  # candidate nodes expanded from the successor table per step
    max_match: int = 8  # longest suffix looked up in the index
    prompt_rows: int = 256  # prompt rows whose logits seed the successor table (LM head cost, once)
    fixed_nodes: int | None = None  # verify exactly this many nodes per step (no cost model): for studies
    memory_tokens: int = 65_536  # earlier generations' text kept searchable when one Tree serves several
    controller: ControllerConfig = ControllerConfig()


class SourceCalibration:
    """How far to trust one source: discounted accepted / predicted over its draft nodes."""

    def __init__(self, prior: float = 2.0, decay: float = 0.98):
        self.decay = decay
        self.predicted = prior
        self.accepted = prior

    @property
    def weight(self) -> float:
        # Above 1 when the source is too modest (a copied passage continues more surely than its
        # frequencies say); per-step probabilities are capped in TokenTrie.add_path.
        return min(max(self.accepted / self.predicted, 0.05), 2.0)

    def update(self, predicted: float, accepted: float) -> None:
        self.predicted = self.decay * self.predicted + predicted
        self.accepted = self.decay * self.accepted + accepted


class CopyCalibration:
    """P(a copied continuation goes on one more token | it has matched L tokens so far), learned online.

    One estimate per L up to `cap` (longer matches share the last), starting from the prior
    L / (L + 2) worth `prior` observations; every verified suffix node whose parent was accepted is one
    observation at its L. Grounded answers that quote their source drive the long-L estimates towards
    1, open-ended chat drives the short ones down, and the tree's depth follows.
    """

    def __init__(self, cap: int = 16, prior: float = 4.0, decay: float = 0.99):
        self.cap, self.decay = cap, decay
        self.trials = [prior] * (cap + 1)
        self.hits = [prior * prior_continue_prob(max(length, 1)) for length in range(cap + 1)]

    def prob(self, length: int) -> float:
        length = min(max(length, 1), self.cap)
        return self.hits[length] / self.trials[length]

    def update(self, length: int, accepted: bool) -> None:
        length = min(max(length, 1), self.cap)
        self.trials[length] = self.decay * self.trials[length] + 1.0
        self.hits[length] = self.decay * self.hits[length] + float(accepted)


class Tree(Strategy):
    """Suffix index + Token Recycling, merged into one tree and sized by the measured cost model."""

    name = "tree"

    def __init__(
        self, config: TreeConfig = TreeConfig(), earlier: list[list[int]] | None = None, costs: StepCosts | None = None
    ):
        """`costs`: measured step costs shared with other generations on the same deployment (a client's)."""
        self.config = config
        self.prompt_logits_rows = config.prompt_rows
        self.recycling = TokenRecycling(config.recycling_k)
        self.controller = BlockController(config.controller, costs)
        self.copy = CopyCalibration()
        self.calibration = SourceCalibration()  # Token Recycling's probabilities come from other contexts
        self.earlier = earlier if earlier is not None else []
        self.last_draft = Draft()
        self.index: SuffixIndex | None = None

    def start(self, prompt, prompt_logits):
        # A Tree kept across generations (a chat, an API server) keeps what it learned: the successor
        # table, the calibrations and the cost fit, and the earlier prompts and outputs stay searchable.
        if self.index is not None:
            self.earlier.append(self.index.docs[self.doc])
            while len(self.earlier) > 1 and sum(map(len, self.earlier)) > self.config.memory_tokens:
                self.earlier.pop(0)
        self.index = SuffixIndex(self.config.max_match)
        for doc in self.earlier:
            self.index.add_doc(doc)
        self.doc = self.index.add_doc(prompt)
        # Row r of prompt_logits predicts what follows the r-th of the prompt's last rows.
        self.recycling.observe(prompt[len(prompt) - prompt_logits.shape[0] :], prompt_logits)

    def propose(self, history):
        trie = TokenTrie()
        self.index.propose(history, trie, self.config.suffix_depth, self.copy.prob)
        self.recycling.propose(
            history[-1], trie, self.config.recycling_nodes, self.config.max_depth, weight=self.calibration.weight,
        )
        scores = sorted(trie.score[1:], reverse=True)
        n = self.config.fixed_nodes if self.config.fixed_nodes is not None else self.controller.choose(scores)
        self.last_draft = trie.best(n)
        return self.last_draft

    def observe(self, tokens, parents, logits, path, emitted, step_ms):
        self.recycling.observe(tokens, logits)
        self.index.extend(self.doc, emitted)
        draft = self.last_draft
        accepted_rows = set(path)
        # Only nodes whose parent was accepted were really tested: their conditional probability is
        # what the source predicted.
        live = [i for i in range(len(draft)) if draft.parents[i] in accepted_rows]
        predicted = accepted = 0.0
        for i in live:
            hit = (i + 1) in accepted_rows
            if draft.sources[i] == "suffix":
                self.copy.update(draft.keys[i][1], hit)
            elif draft.sources[i] == "recycling":
                parent = draft.parents[i]
                predicted += draft.scores[i] / max(draft.scores[parent - 1], 1e-6) if parent > 0 else draft.scores[i]
                accepted += hit
        if predicted > 0:
            self.calibration.update(predicted / self.calibration.weight, accepted)
        self.controller.observe(len(tokens), step_ms, sum(draft.scores), len(path) - 1)


STRATEGIES = {"sequential": Sequential, "jacobi": Jacobi, "lookahead": Lookahead, "tree": Tree}


def make_strategy(name: str, costs: StepCosts | None = None) -> Strategy:
    """A fresh strategy by name; `costs` (a client's measured step costs) goes to those that size blocks."""
    if name == "tree":
        return Tree(costs=costs)
    return STRATEGIES[name]()
