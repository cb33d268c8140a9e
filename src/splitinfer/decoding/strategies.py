"""Decoding strategies: each proposes a draft below the root token and learns from every verified block.

    sequential  no draft: one token per round trip (the reference)
    jacobi      a chain of guesses refined by iteration (the paper's negative result, kept for comparison)
    lookahead   the paper's method: n-grams from a single-token-keyed pool, G candidates of N-1 tokens
    tree        the default: a suffix index, Token Recycling and (where the client has one) a learned draft
                head merged into one tree, ranked by estimated path probability (calibrated online from
                what was accepted; a confident suffix or table path before the head's nodes) and sized each
                step by the measured cost model (controller.py); Token
                Recycling starts from the table shipped for the model and the suffix lookup also searches
                the replies shipped with it and a client's earlier outputs, where given (warm.py);
                tree-nohead is the same without the head

A strategy never checks its own draft; `draft.accept` does, identically for all of them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from .calibration import NodeCalibration
from .controller import BlockController, ControllerConfig, StepCosts
from .draft import Draft, SideRows, TokenTrie
from .headsource import HeadDraftConfig, HeadDrafter
from .sources import NgramPool, SuffixIndex, TokenRecycling, propose_suffix
from .warm import RecyclingTable, SuffixMemory


class Strategy:
    name = "base"
    prompt_logits_rows = 1  # logits rows of the prompt's end the strategy wants at start (the LM head costs)
    uses_features = False  # True: the loop hands it the final features of the prefill and of every block

    def see_features(self, features: torch.Tensor) -> None:
        """[q, d] final features (before the final norm) of the prefill, after `start`, and of each block,
        before `observe`; only for strategies with `uses_features`."""

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

    def recall(self, draft: Draft) -> None:
        """Before `observe` with blocks in flight: the draft of the block observed (later ones were proposed
        since)."""

    def report(self) -> dict:
        """What the strategy did in this generation, for its stats; empty where there is nothing to say."""
        return {}


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


@dataclass
class HeadTally:
    """One generation's count of what the learned head did: the steps it drafted, the block rows only it
    proposed, the accepted tokens only it proposed, and its drafting time."""

    steps: int = 0
    rows: int = 0
    tokens: int = 0
    ms: float = 0.0

    def add(self, rows: int, tokens: int, ms: float) -> None:
        self.steps, self.rows, self.tokens, self.ms = self.steps + 1, self.rows + rows, self.tokens + tokens, self.ms + ms

    def as_dict(self) -> dict:
        return {"steps": self.steps, "rows": self.rows, "tokens": self.tokens, "ms": round(self.ms, 3)}


COPY_SOURCES = ("suffix", "recycling")  # the model-free sources, which a confident path lets go first


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
    reply_store: bool = True  # also search the replies shipped with the successor table (warm.py)
    # Search those replies only at match lengths where this text and the memory have no occurrence (False:
    # pool them with the text's at every length, where another reply's habit can outvote this text's quote).
    replies_fallback: bool = True
    controller: ControllerConfig = ControllerConfig()
    head: HeadDraftConfig = HeadDraftConfig()  # the learned draft head's tree, when a head is given
    # Draft with the head at least every this many steps even when it seems not to pay, so a changed text
    # or link is noticed; each exploration that still finds it not paying doubles the gap, up to the max.
    head_explore_every: int = 8
    head_explore_max: int = 64
    # A suffix or successor-table path at least this likely (calibrated on this text) takes the block's
    # nodes before the head's: the head's calibration is an average over texts, a copy's is this text's.
    copy_first: float = 0.5


class Tree(Strategy):
    """Suffix index + Token Recycling (+ a learned draft head when given), merged into one tree and sized by
    the measured cost model."""

    name = "tree"

    def __init__(
        self, config: TreeConfig = TreeConfig(), earlier: list[list[int]] | None = None, costs: StepCosts | None = None,
        memory: SuffixMemory | None = None, recycling_table: RecyclingTable | None = None, head=None,
    ):
        """`costs`: measured step costs shared with other generations on the same deployment (a client's);
        `memory`: earlier outputs of the same client, searched with this text (warm.py); `recycling_table`:
        the successor table to start from (warm.py); `head`: a DraftHead (model/drafthead.py) over this
        model, drafting from the final features."""
        self.config = config
        self.drafter = HeadDrafter(head, config.head) if head is not None else None
        self.uses_features = self.drafter is not None
        self._features: torch.Tensor | None = None
        self.prompt_logits_rows = config.prompt_rows
        self.recycling = TokenRecycling(config.recycling_k)
        if recycling_table is not None:
            self.recycling.warm(recycling_table.successors)
        self.replies = recycling_table.replies if recycling_table is not None and config.reply_store else None
        self.memory = memory
        self.controller = BlockController(config.controller, costs)
        self.calibration = NodeCalibration()  # per-node trust in each source; the controller adds its residual
        self.earlier = earlier if earlier is not None else []
        self.last_draft = Draft()
        self.index: SuffixIndex | None = None
        self._prompt: list[int] | None = None
        self._draft_ms = 0.0
        self.head_value = self.controller.costs.head  # what the head is worth here, measured over generations
        self._drafted = False
        self._since_head = 0
        self._explore_gap = config.head_explore_every
        self._tally = HeadTally()

    def start(self, prompt, prompt_logits):
        # A Tree kept across generations (a chat, an API server) keeps what it learned: the successor
        # table, the calibrations and the cost curve, and the earlier prompts and outputs stay searchable.
        if self.index is not None:
            self.earlier.append(self.index.docs[self.doc])
            while len(self.earlier) > 1 and sum(map(len, self.earlier)) > self.config.memory_tokens:
                self.earlier.pop(0)
        self.index = SuffixIndex(self.config.max_match)
        for doc in self.earlier:
            self.index.add_doc(doc)
        self.doc = self.index.add_doc(prompt)
        self._tally = HeadTally()
        # Row r of prompt_logits predicts what follows the r-th of the prompt's last rows.
        self.recycling.observe(prompt[len(prompt) - prompt_logits.shape[0] :], prompt_logits)
        self._prompt = prompt

    def see_features(self, features):
        if self._prompt is not None:  # the prefill's rows
            self.drafter.start(self._prompt, features)
            self._prompt = None
        else:
            self._features = features

    def _head_pays(self) -> bool:
        """Draft with the head when the tokens it adds per step are worth more time than it costs a step
        (drafting, and verifying the rows only it proposed), and now and then regardless (exploration)."""
        self._since_head += 1
        if self.head_value.pays():
            self._since_head, self._explore_gap = 0, self.config.head_explore_every
            return True
        if self._since_head >= self._explore_gap:
            self._since_head = 0
            self._explore_gap = min(2 * self._explore_gap, self.config.head_explore_max)
            return True
        return False

    def _learn_head_value(self, path: list[int], rows: int, step_ms: float, emitted: int) -> None:
        self.head_value.observe_step(emitted, step_ms - self._draft_ms)
        if self._drafted:
            # Only tokens and rows no other source proposed are the head's: the rest would have been sent
            # without it. What its rows cost follows the controller's curve of what a block of q rows costs.
            head_only = [who == ("head",) for who in self.last_draft.proposers]
            verify_ms = self.controller.block_ms(rows) - self.controller.block_ms(rows - sum(head_only))
            accepted = sum(head_only[row - 1] for row in path[1:])
            self.head_value.observe_drafting(accepted, self._draft_ms + max(verify_ms, 0.0))
            self._tally.add(sum(head_only), accepted, self._draft_ms)

    def propose(self, history):
        trie = TokenTrie()
        draft_ms = 0.0
        self._drafted = self.drafter is not None and self._head_pays()
        if self._drafted:
            self.drafter.propose(history[-1], trie)
            draft_ms = self.drafter.draft_ms
        elif self.drafter is not None:
            self.drafter.sync(history[-1])
        self._propose_suffix(history, trie)
        self.recycling.propose(
            history[-1], trie, self.config.recycling_nodes, self.config.max_depth,
            weight=self.calibration.recycling_weight,
        )
        scores = sorted(trie.score[1:], reverse=True)
        # The head's drafting time is spent by now whatever the block's size, so it does not size the block
        # (pricing it per row would cut a confident copy short); `_head_pays` weighs it against the head's yield.
        n = self.config.fixed_nodes if self.config.fixed_nodes is not None else self.controller.choose(scores)
        self.last_draft = trie.best(n, COPY_SOURCES, self.config.copy_first)
        self._draft_ms = draft_ms
        return self.last_draft

    def _propose_suffix(self, history, trie) -> None:
        """The suffix lookup over, oldest first (the most recent occurrences count when there are too many),
        the shipped replies, this client's earlier outputs and this text; the replies only where the other
        two have no occurrence, unless configured to pool them."""
        own = (self.index,) if self.memory is None else (self.memory.index, self.index)
        replies = () if self.replies is None else (self.replies,)
        indexes, fallback = (own, replies) if self.config.replies_fallback else ((*replies, *own), ())
        propose_suffix(indexes, history, trie, self.config.suffix_depth, self.calibration.continue_prob,
                       self.index.max_occurrences, fallback)

    def predict(self, history, nodes):
        trie = TokenTrie()
        self._propose_suffix(history, trie)
        self.recycling.propose(history[-1], trie, self.config.recycling_nodes, self.config.max_depth,
                               weight=self.calibration.recycling_weight)
        return trie.best(nodes)

    def recall(self, draft):
        self.last_draft = draft

    def report(self):
        return {"draft_head": self._tally.as_dict()} if self.drafter is not None else {}

    def observe(self, tokens, parents, logits, path, emitted, step_ms):
        if self.drafter is not None:
            self.drafter.observe(self._features[path], emitted)
            self._learn_head_value(path, len(tokens), step_ms, len(emitted))
            # The curve prices verification; the head's drafting time is weighed by `_head_pays`.
            step_ms = max(step_ms - self._draft_ms, 0.0)
        self.recycling.observe(tokens, logits)
        self.index.extend(self.doc, emitted)
        draft = self.last_draft
        self.calibration.observe(draft.keys, draft.parents, set(path))
        self.controller.observe(len(tokens), step_ms, sum(draft.scores), len(path) - 1)


# "tree-nohead": the tree without the learned draft head even where the client has one (for comparisons).
STRATEGIES = {"sequential": Sequential, "jacobi": Jacobi, "lookahead": Lookahead, "tree": Tree, "tree-nohead": Tree}


def make_strategy(
    name: str, costs: StepCosts | None = None, memory: SuffixMemory | None = None,
    recycling_table: RecyclingTable | None = None, head=None,
) -> Strategy:
    """A fresh strategy by name; `costs` (a client's measured step costs) goes to those that size blocks,
    `memory` and `recycling_table` (warm starts, warm.py) and `head` (a learned draft head, when the client
    has one) to those that draft from them."""
    if name in ("tree", "tree-nohead"):
        return Tree(costs=costs, memory=memory, recycling_table=recycling_table,
                    head=head if name == "tree" else None)
    return STRATEGIES[name]()
