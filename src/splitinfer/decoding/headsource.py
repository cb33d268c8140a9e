"""Draft tokens from a learned draft head (model/drafthead.py), one more source of the token trie.

The head reads pairs (feature f_t, token x_{t+1}) and predicts f_{t+1}. `HeadDrafter` keeps the head's
KV cache in step with the committed context: the prompt's pairs after prefill, then after each step the
pairs of the accepted path (root, accepted drafts, each with the token that followed it). Rejected rows
never enter the cache, so nothing has to be undone. The pairs of steps that draft nothing with the head
wait in a backlog and enter the cache in one head pass before it next drafts (`catch_up`): where the head
does not pay, the tree drafts with it on few steps, and a pass on every step cost drafting 6.3 ms a tree
step against 4.3 without (notes/benchmarks.md, weight formats). The newest pair's prediction (the "tip") is
the model's next feature as the head sees it; `propose` grows a tree below the root from it, EAGLE-2 style:
every depth expands the `beam` nodes of highest path probability into their `top_k` children, for at
most `max_depth` levels and `max_nodes` nodes, and adds each node with its conditional probability.
Expansion stops where no node of a level reaches `min_path_prob`: on text the head cannot predict,
drafting costs one or two head passes instead of `max_depth`.

The head's softmax is not a calibrated probability (it is over- or under-confident by depth and by rank
among siblings), and the trie ranks its nodes against the other sources' by these numbers. So each node's
probability is the head's times a `Ratio` (calibration.py) keyed by (depth, whether it is its parent's
first choice), learned from every step: a proposed node whose path to it matches the emitted tokens was
tested by them, whether or not the block carried it (predicted += head probability, accepted += hit).

A fused head (EAGLE-3's feature fusion, `drafter train --fuse`) also reads, on the committed rows only,
the hidden states its `fused_layers` name: the loop hands them after the final features of each row
(Strategy.feature_states), and the runner refuses states that do not cross its wire (a split drawn at
another depth than the head was trained on). Tree nodes read the head's own predictions, without them,
as in training.

Only the trusted side runs this: the head's input features come from its own tail layers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..model.drafthead import DraftHead, HeadCache
from .calibration import Ratio
from .draft import TokenTrie


@dataclass(frozen=True)
class HeadDraftConfig:
    top_k: int = 3  # children per expanded node
    beam: int = 2  # nodes expanded per depth
    max_depth: int = 3  # each depth is one head pass and one readout; deeper nodes are rarely accepted
    max_nodes: int = 10
    min_path_prob: float = 0.05  # expand only nodes at least this likely (calibrated path probability)
    calibration_prior: float = 2.0  # predicted units each calibration ratio starts from, at ratio 1
    calibration_decay: float = 0.98  # weight of history in each ratio
    calibration_depths: int = 4  # deeper nodes share the last depth's ratios
    ahead_rows: int = 8  # rows of a block in flight the head chains along to draft the next tree ahead (a pass each)


@dataclass
class _Node:
    token: int
    parent: int  # index of the parent node, -1 below the tip
    depth: int  # 1 for the root's children
    prob: float  # conditional probability given the parent, calibrated
    path_prob: float
    raw: float  # the head's own probability
    key: tuple[int, bool]  # (depth, first choice) of its calibration ratio


@dataclass(frozen=True)
class AheadTree:
    """A tree drafted while a block was in flight (`draft_ahead`), for one outcome of it: `kept` tokens of its
    draft accepted below its root, then `root` chosen."""

    kept: list[int]
    root: int
    nodes: list[_Node]
    score: float  # the outcome's chance as judged when drafting


class HeadDrafter:
    def __init__(self, head: DraftHead, config: HeadDraftConfig = HeadDraftConfig()):
        self.head = head
        self.config = config
        self.draft_ms = 0.0  # wall time of the last `propose`
        self.drafted = 0  # nodes it added
        self.ratios: dict[tuple[int, bool], Ratio] = {}
        self._nodes: list[_Node] = []  # the last proposed tree, until its step is observed
        self._predicted: dict[int, torch.Tensor] = {}  # the last grown tree's nodes' predicted features
        self._reset(0)

    def _ratio(self, key: tuple[int, bool]) -> Ratio:
        if key not in self.ratios:
            self.ratios[key] = Ratio(self.config.calibration_prior, self.config.calibration_decay, floor=0.05, cap=4.0)
        return self.ratios[key]

    def _calibrate(self, emitted: list[int]) -> None:
        """Learn from the last proposed tree: a node was tested when its ancestors' tokens are the emitted
        ones before its depth."""
        matched = {-1: True}
        for i, node in enumerate(self._nodes):
            matched[i] = False
            if node.depth > len(emitted) or not matched[node.parent]:
                continue
            hit = node.token == emitted[node.depth - 1]
            matched[i] = hit
            self._ratio(node.key).update(node.raw, float(hit))
        self._nodes = []

    def _reset(self, position: int) -> None:
        self.cache = HeadCache()
        self.position = position  # the position of the next pair
        self.pending: torch.Tensor | None = None  # the newest committed row's feature, awaiting its next token
        self.tip: torch.Tensor | None = None
        self.backlog: list[tuple[torch.Tensor, list[int]]] = []  # committed pairs not yet in the cache, oldest first

    @torch.inference_mode()
    def start(self, prompt: list[int], features: torch.Tensor) -> None:
        """features: [m, d] of the prompt's last m rows (m <= len(prompt)); earlier rows stay unseen. A fused
        head's rows carry its `fused_layers` states after the final features: [m, d (1 + F)]."""
        m = min(features.shape[0], len(prompt))
        self._reset(len(prompt) - m)
        self._extend(features[-m:-1], prompt[len(prompt) - m + 1 :])
        self.pending = features[-1]

    @torch.inference_mode()
    def observe(self, features: torch.Tensor, emitted: list[int]) -> None:
        """features: [k + 1, d] of the accepted path's rows (root first); emitted: the k accepted drafts and
        the next root, the token that followed each of those rows (a fused head's: [k + 1, d (1 + F)])."""
        self.pending = None
        self._calibrate(emitted)
        self.backlog.append((features, list(emitted)))

    @torch.inference_mode()
    def catch_up(self) -> None:
        """Run the head over the backlog of committed pairs, in one pass: the cache and the tip are then
        those of the committed context."""
        if self.backlog:
            rows = torch.cat([features for features, _ in self.backlog])
            tokens = [token for _, emitted in self.backlog for token in emitted]
            self.backlog = []
            self._extend(rows, tokens)

    def _extend(self, rows: torch.Tensor, next_tokens: list[int]) -> None:
        """Add the pairs (row's features, next token) of committed rows to the cache; rows [n, d (1 + F)]."""
        d = self.head.config.hidden_size
        self._append(rows[:, :d], next_tokens, rows[:, d:] if self.head.config.fused_layers else None)

    def _append(self, features: torch.Tensor, next_tokens: list[int], fused: torch.Tensor | None = None) -> None:
        """Add the pairs (features [n, d], next token) to the cache, after it; the tip becomes the last one's
        prediction. fused: [n, F d] of a fused head's committed rows (None for its own predictions)."""
        n = len(next_tokens)
        if n == 0:
            return
        past = self.cache.length
        allowed = torch.ones(n, past + n, dtype=torch.bool)
        allowed[:, past:] = torch.ones(n, n, dtype=torch.bool).tril()
        positions = torch.arange(self.position, self.position + n)
        tokens = torch.tensor([next_tokens])
        predicted, keys, values = self.head(features[None].float(), tokens, positions, allowed, self.cache,
                                            fused=None if fused is None else fused[None])
        self.cache.extend(keys, values)
        self.position += n
        self.tip = predicted[0, -1]

    @torch.inference_mode()
    def sync(self, root: int) -> None:
        """Add the pair (newest committed feature, root) to the committed pairs; `propose` does it, a step
        that drafts nothing with the head calls it instead so no pair is missed."""
        if self.pending is not None:
            self.backlog.append((self.pending[None], [root]))
            self.pending = None

    @torch.inference_mode()
    def propose(self, root: int, trie: TokenTrie) -> int:
        """Add a tree below `root` (the last emitted token) to `trie`; returns the nodes added."""
        self.sync(root)
        self.catch_up()  # not in `draft_ms`: the pass a step cost before the backlog, paid in one go
        t0 = time.perf_counter()
        if self.tip is None:
            return 0
        self._add(self._grow(), trie)
        self.draft_ms = (time.perf_counter() - t0) * 1e3
        return self.drafted

    def _grow(self) -> list[_Node]:
        """The tree below the tip: its nodes, parents first (their predicted features in `_predicted`)."""
        self._predicted = {}
        nodes: list[_Node] = []
        level = self._children(self.tip[None], [-1], nodes)
        tree_keys = tree_values = None
        rows: dict[int, int] = {}  # expanded node -> its row among the tree's keys
        while level and len(nodes) < self.config.max_nodes and nodes[level[0]].depth < self.config.max_depth:
            expand = [i for i in sorted(level, key=lambda i: -nodes[i].path_prob)[: self.config.beam]
                      if nodes[i].path_prob >= self.config.min_path_prob]
            if not expand:
                break
            predicted, keys, values = self._run(nodes, expand, rows, tree_keys, tree_values)
            for i in expand:
                rows[i] = len(rows)
            tree_keys = keys if tree_keys is None else torch.cat([tree_keys, keys], 2)
            tree_values = values if tree_values is None else torch.cat([tree_values, values], 2)
            level = self._children(predicted, expand, nodes)
        return nodes

    def _add(self, nodes: list[_Node], trie: TokenTrie) -> None:
        """Add the best `max_nodes` of a grown tree to the trie; they are what the next `observe` learns from.
        A child is never likelier than its parent, so the best nodes include their ancestors."""
        best = sorted(range(len(nodes)), key=lambda i: (-nodes[i].path_prob, i))[: self.config.max_nodes]
        for i in best:
            tokens, probs = self._path(nodes, i)
            trie.add_path(tokens, probs, "head")
        self._nodes = nodes
        self.drafted = len(best)

    @torch.inference_mode()
    def draft_ahead(self, path: list[int], reach: list[float], taken: list[set[int]]) -> AheadTree | None:
        """While a block is in flight (after its step's `propose` or `sync`): the tree for its likeliest outcome,
        drafted from the head's own predictions of the block's features (the true ones come with its result);
        None before any features. path: the tokens of the block's top path below its root; reach[j]: the chance that its first
        j + 1 are kept; taken[j]: the block's tokens below row j (row 0 the root), never chosen after it.

        The head chains along the path (one pass a row); a prefix kept, then the likeliest token not taken
        there, scores its reach times the head's chance of that token; the best one's tree is grown. The
        committed state is left as it was (the backlog caught up first)."""
        self.catch_up()
        if self.tip is None or self.pending is not None:
            return None
        saved = self.cache, self.position, self.tip, self._predicted
        try:
            self.cache = HeadCache(self.cache.keys, self.cache.values)
            features = [self.tip]  # row j's feature, as the head predicts it (row 0: the root's)
            for token in path:
                self._append(features[-1][None], [token])
                features.append(self.tip)
            kept, root, score = self._likeliest(torch.stack(features), reach, taken)
            self.cache.truncate(saved[0].length + kept)
            self.position = saved[1] + kept
            self._append(features[kept][None], [root])
            return AheadTree(path[:kept], root, self._grow(), score)
        finally:
            self.cache, self.position, self.tip, self._predicted = saved

    def _likeliest(self, features: torch.Tensor, reach: list[float], taken: list[set[int]]) -> tuple[int, int, float]:
        """(rows kept below the root, the token chosen after them, the outcome's chance) of the likeliest
        outcome, from the head's distribution after each row of the chained path (features [k + 1, d])."""
        probs = torch.softmax(self.head.logits(features), dim=-1)
        best = (0, -1, -1.0)
        for j, row in enumerate(probs):
            chance = 1.0 if j == 0 else reach[j - 1]
            top = row.topk(min(len(taken[j]) + 1, row.shape[0]))
            for token, p in zip(self.head.draft_vocab[top.indices].tolist(), top.values.tolist()):
                if token not in taken[j]:
                    if chance * p > best[2]:
                        best = (j, token, chance * p)
                    break
        return best

    @torch.inference_mode()
    def propose_ahead(self, ahead: AheadTree, root: int, trie: TokenTrie) -> int:
        """`propose`, where the tree drafted ahead was for this outcome: the first level afresh from the true
        tip (a readout, no head pass), each deeper node of the ahead tree below the first-level token it hangs
        from, recalibrated with today's ratios. Returns the nodes added."""
        self.sync(root)
        self.catch_up()
        t0 = time.perf_counter()
        nodes: list[_Node] = []
        first = {nodes[i].token: i for i in self._children(self.tip[None], [-1], nodes)}
        mapped: dict[int, int] = {}  # ahead node -> its node here
        for i, node in enumerate(ahead.nodes):
            if node.depth == 1:
                if node.token in first:
                    mapped[i] = first[node.token]
                continue
            parent = mapped.get(node.parent)
            if parent is None:
                continue
            prob = min(node.raw * self._ratio(node.key).value, 1.0)
            mapped[i] = len(nodes)
            nodes.append(_Node(node.token, parent, node.depth, prob, nodes[parent].path_prob * prob, node.raw, node.key))
        self._add(nodes, trie)
        self.draft_ms = (time.perf_counter() - t0) * 1e3
        return self.drafted

    def _children(self, predicted: torch.Tensor, parents: list[int], nodes: list[_Node]) -> list[int]:
        """Add the top-k children of each of `parents` (their predicted features [n, d]); their indices."""
        probs = torch.softmax(self.head.logits(predicted), dim=-1)
        top = probs.topk(min(self.config.top_k, probs.shape[-1]), dim=-1)
        ids = self.head.draft_vocab[top.indices].tolist()
        added = []
        for parent, row_ids, row_ps in zip(parents, ids, top.values.tolist()):
            depth = 1 if parent < 0 else nodes[parent].depth + 1
            base = 1.0 if parent < 0 else nodes[parent].path_prob
            for rank, (token, p) in enumerate(zip(row_ids, row_ps)):
                key = (min(depth, self.config.calibration_depths), rank == 0)
                calibrated = min(p * self._ratio(key).value, 1.0)
                added.append(len(nodes))
                nodes.append(_Node(token, parent, depth, calibrated, base * calibrated, p, key))
        return added

    def _run(self, nodes, expand, rows, tree_keys, tree_values):
        """One head pass over the pairs (parent's predicted feature, node token) of the nodes in `expand`."""
        past, done, n = self.cache.length, len(rows), len(expand)
        allowed = torch.zeros(n, past + done + n, dtype=torch.bool)
        allowed[:, :past] = True
        features = []
        for j, i in enumerate(expand):
            allowed[j, past + done + j] = True
            ancestor = nodes[i].parent
            while ancestor >= 0:
                allowed[j, past + rows[ancestor]] = True
                ancestor = nodes[ancestor].parent
            parent = nodes[i].parent
            features.append(self.tip if parent < 0 else self._predicted[parent])
        cache = self.cache
        if tree_keys is not None:
            cache = HeadCache(torch.cat([self.cache.keys, tree_keys], 2), torch.cat([self.cache.values, tree_values], 2))
        positions = torch.tensor([self.position + nodes[i].depth - 1 for i in expand])
        tokens = torch.tensor([[nodes[i].token for i in expand]])
        predicted, keys, values = self.head(torch.stack(features)[None], tokens, positions, allowed, cache)
        for j, i in enumerate(expand):
            self._predicted[i] = predicted[0, j]
        return predicted[0], keys, values

    @staticmethod
    def _path(nodes: list[_Node], i: int) -> tuple[list[int], list[float]]:
        tokens, probs = [], []
        while i >= 0:
            tokens.append(nodes[i].token)
            probs.append(nodes[i].prob)
            i = nodes[i].parent
        return tokens[::-1], probs[::-1]
