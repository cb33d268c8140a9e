"""Drafts, token tries and the acceptance rule (pure functions; no model, no network).

A step verifies one block: row 0 is the *root*, the last emitted token that has not been run through the
model yet, and rows 1.. are draft tokens arranged as a tree (`parents[i]` is the block row of row i's
parent). Running the block gives one logits row per block row; logits row r predicts the token that
follows the path ending at r. Acceptance walks from the root: choose a token from the row's
distribution (argmax for greedy); if a child of the row carries that token, move to it and repeat,
otherwise stop. The chosen tokens are exactly those that decoding without a draft would have chosen,
so greedy output is identical to sequential decoding, and with sampling each token is still drawn from
the model's own distribution at that point (exact speculative sampling for one-hot drafts).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from ..masks import BlockStructure, tree_allowed, tree_depths

# No source is ever certain; a calibrated weight above 1 must not make a path probability exceed 1.
MAX_STEP_PROB = 0.98


@dataclass
class SideRows:
    """Rows verified in the same block as the tree but never accepted (e.g. a Jacobi lookahead window).

    Side row i sits `depths[i]` positions below the root and sees the root and the side rows in
    `sees[i]` (itself included); no tree row sees a side row, so the tree's logits are unchanged.
    """

    tokens: list[int]
    depths: list[int]
    sees: list[list[int]]


@dataclass
class Draft:
    """Draft nodes below the root. Node i is block row i + 1; parents index block rows (0 = root)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)  # estimated probability that the node is accepted
    sources: list[str] = field(default_factory=list)  # which source gave each node its score
    keys: list[object] = field(default_factory=list)  # the source's calibration key for each node (or None)
    proposers: list[tuple[str, ...]] = field(default_factory=list)  # every source that proposed each node
    side: SideRows | None = None  # rows after the tree that only gather information

    def __len__(self) -> int:
        return len(self.tokens)

    def block(self, root: int) -> tuple[list[int], list[int]]:
        """(block tokens, block parents) with the root as row 0."""
        return [root, *self.tokens], [-1, *self.parents]

    def to_block(self, root: int) -> Block:
        """Everything one step verifies: the tree below `root`, then the side rows if there are any."""
        tokens, parents = self.block(root)
        if self.side is not None and self.side.tokens:
            allowed, depths = block_layout(parents, self.side)
            return Block(tokens + self.side.tokens, parents, BlockStructure.matrix(allowed), depths)
        structure = BlockStructure.tree(parents) if len(tokens) > 1 else BlockStructure.chain()
        return Block(tokens, parents, structure, None)


@dataclass(frozen=True)
class Block:
    """The rows of one verification: the tree's rows (root first), then any side rows.

    Only the tree's rows can be accepted; side rows gather information for the strategy that drew them.
    """

    tokens: list[int]  # every row's token: the tree's, then the side rows'
    parents: list[int]  # the tree's rows only; row 0 (the root) has -1
    structure: BlockStructure  # which rows each row sees
    depths: list[int] | None  # each row's distance from the committed sequence; None: the structure's own

    @property
    def tree_tokens(self) -> list[int]:
        return self.tokens[: len(self.parents)]


class TokenTrie:
    """Candidate continuations merged from several sources, each node with its best estimated path probability."""

    def __init__(self):
        self.children: list[dict[int, int]] = [{}]  # node 0 is the root
        self.token: list[int] = [-1]
        self.parent: list[int] = [-1]
        self.score: list[float] = [1.0]
        self.source: list[str] = [""]
        self.key: list[object] = [None]
        self.proposed: list[dict[str, float]] = [{}]  # each source's best path probability for the node

    def add_path(self, tokens: list[int], probs: list[float], source: str = "", keys: list | None = None) -> None:
        """Insert a continuation; probs[i] is the conditional probability of tokens[i] given the path.

        keys[i], if given, is what the source will learn from when node i is verified (see calibration.py).
        """
        node, path_prob = 0, 1.0
        keys = keys if keys is not None else [None] * len(tokens)
        for token, p, key in zip(tokens, probs, keys):
            node, path_prob = self.add_child(node, path_prob, token, p, source, key)

    def add_child(self, node: int, path_prob: float, token: int, p: float, source: str = "", key=None) -> tuple[int, float]:
        """One step of `add_path`: `token` below `node`, reached along a path of probability `path_prob` (the
        source's own, not the node's score), with conditional probability p -> (the child, its path probability).
        A source growing paths node by node (Token Recycling) inserts each node once, not its whole path again."""
        path_prob *= min(p, MAX_STEP_PROB)
        child = self.children[node].get(token)
        if child is None:
            child = len(self.token)
            self.children[node][token] = child
            self.children.append({})
            self.token.append(token)
            self.parent.append(node)
            self.score.append(path_prob)
            self.source.append(source)
            self.key.append(key)
            self.proposed.append({})
        elif path_prob > self.score[child]:
            self.score[child] = path_prob
            self.source[child] = source
            self.key[child] = key
        proposed = self.proposed[child]
        proposed[source] = max(proposed.get(source, 0.0), path_prob)
        return child, path_prob

    def __len__(self) -> int:
        return len(self.token) - 1

    def best(self, budget: int, first: tuple[str, ...] = (), confident: float = 1.0) -> Draft:
        """The `budget` nodes with the highest path scores, as a connected tree in breadth-first order;
        nodes that a source in `first` proposed with a path probability of at least `confident` come
        before all others.

        A node's score never exceeds its parent's, and ties are broken by depth, so the chosen set always
        contains the ancestors of every chosen node. The nodes that come first keep that: a source reaches
        a node only through its parent, with a path probability no lower there.
        """
        if budget <= 0 or len(self) == 0:
            return Draft()
        depth = [0] * len(self.token)
        for n in range(1, len(self.token)):
            depth[n] = depth[self.parent[n]] + 1
            # keep the invariant explicit even if a source reported a child above its parent
            self.score[n] = min(self.score[n], self.score[self.parent[n]])
        ahead = [any(self.proposed[n].get(source, 0.0) >= confident for source in first) for n in range(len(self.token))]
        ranked = sorted(range(1, len(self.token)), key=lambda n: (not ahead[n], -self.score[n], depth[n], n))[:budget]
        chosen = sorted(ranked, key=lambda n: (depth[n], n))
        row = {0: 0}
        draft = Draft()
        for n in chosen:
            if self.parent[n] not in row:
                continue  # cannot happen with monotone scores; guards rounding ties
            row[n] = len(draft.tokens) + 1
            draft.tokens.append(self.token[n])
            draft.parents.append(row[self.parent[n]])
            draft.scores.append(self.score[n])
            draft.sources.append(self.source[n])
            draft.keys.append(self.key[n])
            draft.proposers.append(tuple(sorted(self.proposed[n])))
        return draft


def block_layout(parents: list[int], side: SideRows) -> tuple[np.ndarray, list[int]]:
    """The [q, q] visibility and the depth of every row of a tree block followed by side rows."""
    t, r = len(parents), len(side.tokens)
    allowed = np.zeros((t + r, t + r), dtype=bool)
    allowed[:t, :t] = tree_allowed(parents)
    for i, seen in enumerate(side.sees):
        allowed[t + i, 0] = True
        allowed[t + i, [t + j for j in seen]] = True
    return allowed, tree_depths(parents) + list(side.depths)


def children_of(tokens: list[int], parents: list[int]) -> dict[int, dict[int, int]]:
    """Block row -> {token: child row} for the draft rows of a block."""
    children: dict[int, dict[int, int]] = {}
    for row in range(1, len(tokens)):
        children.setdefault(parents[row], {})[tokens[row]] = row
    return children


def accept(
    tokens: list[int], parents: list[int], logits: torch.Tensor, choose: Callable[[torch.Tensor], int]
) -> tuple[list[int], int]:
    """Walk the verified block. Returns (accepted block rows starting with 0, the next chosen token).

    tokens, parents: the block (row 0 is the root). logits: [q, vocab]. choose: a row -> a token.
    """
    children = children_of(tokens, parents)
    path, row = [0], 0
    while True:
        token = choose(logits[row])
        child = children.get(row, {}).get(token)
        if child is None:
            return path, token
        path.append(child)
        row = child
