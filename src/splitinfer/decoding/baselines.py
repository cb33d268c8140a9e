"""The strategies kept for comparison with the tree (strategy.py says what a strategy is):

    jacobi      a chain of guesses refined by iteration (the paper's negative result)
    lookahead   the paper's method: n-grams from a single-token-keyed pool, G candidates of N-1 tokens
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from ..errors import ConfigError
from .draft import Draft, SideRows, TokenTrie
from .sources import NgramPool
from .strategy import Strategy


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
