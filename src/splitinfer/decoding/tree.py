"""The default strategy: a suffix index, Token Recycling and (where the client has one) a learned draft
head merged into one tree, ranked by estimated path probability (calibrated online from what was
accepted; a confident suffix or table path before the head's nodes) and sized each step by the measured
cost model (controller.py). Token Recycling starts from the table shipped for the model and the suffix
lookup also searches the replies shipped with it and a client's earlier outputs, where given (warm.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .calibration import NodeCalibration
from .controller import BlockController, ControllerConfig, StepCosts
from .draft import Draft, TokenTrie, children_of
from .headsource import AheadTree, HeadDraftConfig, HeadDrafter
from .roots import top_path
from .sources import SuffixIndex, TokenRecycling, propose_suffix
from .strategy import Strategy
from .warm import RecyclingTable, SuffixMemory


@dataclass
class HeadTally:
    """One generation's count of what the learned head did: the steps it drafted, the block rows only it
    proposed, the accepted tokens only it proposed, and its drafting time."""

    steps: int = 0
    rows: int = 0
    tokens: int = 0
    ms: float = 0.0  # drafting on the critical path
    ahead: int = 0  # trees drafted ahead, while a block was in flight
    ahead_used: int = 0  # of them, those whose outcome came (their steps' drafting is a readout and a graft)
    ahead_ms: float = 0.0  # time drafting ahead, off the critical path where the client waits on the network

    def add(self, rows: int, tokens: int, ms: float) -> None:
        self.steps, self.rows, self.tokens, self.ms = self.steps + 1, self.rows + rows, self.tokens + tokens, self.ms + ms

    def as_dict(self) -> dict:
        return {"steps": self.steps, "rows": self.rows, "tokens": self.tokens, "ms": round(self.ms, 3),
                "ahead": self.ahead, "ahead_used": self.ahead_used, "ahead_ms": round(self.ahead_ms, 3)}


COPY_SOURCES = ("suffix", "recycling")  # the model-free sources, which a confident path lets go first
AHEAD_RETRY = 0.9  # each step skipped for drafting ahead counts its last cost down by this factor


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
    # With a head, where blocks go without waiting (--in-flight 2 or more, or auto): draft the next tree while
    # the block is on the network, for its likeliest outcome (headsource.py `draft_ahead`), while that costs
    # less than this share of a step's measured time (the wait it hides in; 0: never).
    ahead_share: float = 0.5


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
        self.drafts_ahead = self.drafter is not None and config.ahead_share > 0
        self._ahead: tuple[int, list[int], AheadTree] | None = None  # (history length, its tail, the tree)
        self._ahead_ms = 0.0  # the last tree drafted ahead's cost, ms
        self.feature_states = head.config.fused_layers if head is not None else ()
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
        ahead, self._ahead = self._ahead, None
        held = ahead is not None and len(history) == ahead[0] and history[-len(ahead[1]) :] == ahead[1]
        # a tree drafted ahead for what came costs the step a readout: the head drafts whether it pays or not
        self._drafted = held or (self.drafter is not None and self._head_pays())
        if held:
            self.drafter.propose_ahead(ahead[2], history[-1], trie)
            self._tally.ahead_used += 1
        elif self._drafted:
            self.drafter.propose(history[-1], trie)
        elif self.drafter is not None:
            self.drafter.sync(history[-1])
        draft_ms = self.drafter.draft_ms if self._drafted else 0.0
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

    def draft_ahead(self, history, draft):
        """The head's tree for the in-flight block's likeliest outcome: along its top path, a prefix kept and
        the token chosen after it (HeadDrafter.draft_ahead); `propose` grafts it if that outcome comes. Not
        where the last one cost more than `ahead_share` of a step of this block's rows (a short wait)."""
        self._ahead = None
        if not self.drafts_ahead:
            return
        if self._ahead_ms > self.config.ahead_share * self.controller.block_ms(len(draft) + 1):
            self._ahead_ms *= AHEAD_RETRY  # tried again after some steps: the last cost may have been a one-off
            return
        t0 = time.perf_counter()
        path = top_path(draft)[: self.config.head.ahead_rows + 1]
        children = children_of(*draft.block(history[-1]))
        taken = [set(children.get(row, {})) for row in path]
        tokens = [draft.tokens[row - 1] for row in path[1:]]
        tree = self.drafter.draft_ahead(tokens, [draft.scores[row - 1] for row in path[1:]], taken)
        if tree is not None:
            tail = [history[-1], *tree.kept, tree.root]
            self._ahead = (len(history) + len(tail) - 1, tail, tree)
            self._tally.ahead += 1
        self._ahead_ms = (time.perf_counter() - t0) * 1e3
        self._tally.ahead_ms += self._ahead_ms

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
