"""Where draft tokens come from. Each source adds candidate continuations of the context to a TokenTrie.

- `SuffixIndex`: the longest suffix of the context that occurred before (in the prompt, the output so
  far, earlier outputs) and what followed it, with frequencies (the idea of SuffixDecoding / prompt
  lookup, kept as an n-gram position index).
- `TokenRecycling`: for every token, the top-k successors the model predicted the last time that token
  was an input row, with their probabilities; recorded from logits rows the LM head computes anyway.
- `NgramPool`: the original paper's lookahead pool: n-grams keyed on a single token, most recent first.

Sources only propose; checking is the verifier's job.
"""

from __future__ import annotations

import heapq
import itertools
from collections import defaultdict, deque
from collections.abc import Callable

import torch

from .calibration import prior_continue_prob
from .draft import TokenTrie


class SuffixIndex:
    """Positions of all n-grams (n <= max_match) over a few token sequences, for continuation lookup.

    A continuation's conditional probability at each node is (chance that a copy which has matched L
    tokens so far goes on one more) x (share of the earlier occurrences that continued with this token).
    A node at depth d below a match of n tokens has matched L = n + d - 1 tokens if its ancestors are
    accepted, so a long copy (a quoted passage, repeated code) grows more confident as it goes, which is
    what lets the tree send deep chains exactly where they pay. The first factor is `continue_prob(L)`,
    learned online from which nodes were accepted (each node carries the key ("suffix", L) for that;
    calibration.py).
    """

    def __init__(self, max_match: int = 8, max_occurrences: int = 64):
        self.max_match = max_match
        self.max_occurrences = max_occurrences
        self.docs: list[list[int]] = []
        # n-gram -> (doc, end) positions, oldest first; `end` is the index just after the n-gram.
        self._index: dict[tuple[int, ...], list[tuple[int, int]]] = defaultdict(list)

    def add_doc(self, tokens: list[int] = ()) -> int:
        self.docs.append([])
        doc = len(self.docs) - 1
        self.extend(doc, list(tokens))
        return doc

    def extend(self, doc: int, tokens: list[int]) -> None:
        seq = self.docs[doc]
        for token in tokens:
            seq.append(token)
            end = len(seq)
            for n in range(1, min(self.max_match, end) + 1):
                self._index[tuple(seq[end - n : end])].append((doc, end))

    def propose(
        self, context: list[int], trie: TokenTrie, max_depth: int, continue_prob: Callable[[int], float] = prior_continue_prob
    ) -> int:
        """Add continuations of earlier matches of the context's suffix. Returns the longest match length."""
        return propose_suffix((self,), context, trie, max_depth, continue_prob, self.max_occurrences)

    def occurrences(self, ngram: tuple[int, ...]) -> list[tuple[list[int], int]]:
        """(document, end) of every earlier occurrence of `ngram` that something followed, oldest first."""
        return [(self.docs[doc], end) for doc, end in self._index.get(ngram, ()) if end < len(self.docs[doc])]


def propose_suffix(
    indexes, context: list[int], trie: TokenTrie, max_depth: int,
    continue_prob: Callable[[int], float] = prior_continue_prob, max_occurrences: int = 64,
) -> int:
    """Continuations of the context's suffix over several indexes at once (this text, earlier outputs).

    Occurrences of a match in every index count together, later indexes as the more recent ones. The
    longest match counts most, but shorter matches add their (other) occurrences too, with less
    confidence: a single long match gives one path, and the tree wants alternatives below it. Returns the
    longest match length.
    """
    seen: set[tuple[int, int]] = set()
    longest = 0
    max_match = max(index.max_match for index in indexes)
    for n in range(min(max_match, len(context)), 0, -1):
        key = tuple(context[-n:])
        found = [(seq, end) for index in indexes for seq, end in index.occurrences(key)]
        occurrences = [(seq, end) for seq, end in found if (id(seq), end) not in seen][-max_occurrences:]
        if not occurrences:
            continue
        longest = longest or n
        seen.update((id(seq), end) for seq, end in occurrences)
        _add_continuations(occurrences, trie, max_depth, n, continue_prob)
        if len(seen) >= max_occurrences:
            break
    return longest


def _add_continuations(occurrences, trie: TokenTrie, max_depth: int, matched: int, continue_prob) -> None:
    counts: dict[tuple[int, ...], int] = defaultdict(int)
    for seq, end in occurrences:
        continuation = seq[end : end + max_depth]
        for d in range(1, len(continuation) + 1):
            counts[tuple(continuation[:d])] += 1
    total = len(occurrences)

    def conditional(prefix: tuple[int, ...]) -> float:
        parent = counts[prefix[:-1]] if len(prefix) > 1 else total
        return continue_prob(matched + len(prefix) - 1) * counts[prefix] / parent

    internal = {path[:-1] for path in counts}
    for path in counts:
        if path not in internal:  # leaves only: their prefixes are inserted along the way
            depths = range(1, len(path) + 1)
            trie.add_path(
                list(path), [conditional(path[:d]) for d in depths], "suffix",
                [("suffix", matched + d - 1) for d in depths],
            )


class TokenRecycling:
    """Top-k successors per token with probabilities, refreshed from every logits row computed."""

    def __init__(self, k: int = 8):
        self.k = k
        self._next: dict[int, tuple[list[int], list[float]]] = {}

    def observe(self, tokens: list[int], logits: torch.Tensor) -> None:
        """tokens: the block's input tokens; logits: [q, vocab], row r predicts what follows tokens[r]."""
        probs = torch.softmax(logits.float(), dim=-1)
        top = probs.topk(self.k, dim=-1)
        ids, ps = top.indices.tolist(), top.values.tolist()
        for r, token in enumerate(tokens):
            self._next[token] = (ids[r], ps[r])

    def warm(self, successors: dict[int, tuple[list[int], list[float]]]) -> None:
        """Start from a table built offline (warm.py) instead of empty; what this text shows replaces it."""
        self._next.update(successors)

    def propose(self, root: int, trie: TokenTrie, max_nodes: int, max_depth: int, weight: float = 1.0) -> None:
        """Best-first expansion from the root token through the successor table (a max-heap on path probability).

        Each step's probability is the table's p times `weight` (the calibrated trust in this source); each
        node's key ("recycling", p) keeps the uncalibrated p for calibration.py to learn from.
        """
        counter = itertools.count()  # tie-breaker: heapq never compares the lists
        frontier = [(-1.0, next(counter), [root], [])]
        added = 0
        while frontier and added < max_nodes:
            neg_prob, _, path, probs = heapq.heappop(frontier)
            if len(path) > 1:
                trie.add_path(path[1:], [p * weight for p in probs], "recycling", [("recycling", p) for p in probs])
                added += 1
            if len(path) - 1 >= max_depth or path[-1] not in self._next:
                continue
            ids, ps = self._next[path[-1]]
            for token, p in zip(ids, ps):
                heapq.heappush(frontier, (neg_prob * p * weight, next(counter), path + [token], probs + [p]))


class NgramPool:
    """The original lookahead pool: for each token, the (n-1)-grams that followed it, most recent first."""

    def __init__(self, n: int = 5, candidates: int = 5, pool_size: int = 32):
        self.n = n
        self.candidates = candidates
        self._pool: dict[int, deque[tuple[int, ...]]] = defaultdict(lambda: deque(maxlen=pool_size))
        self._seq: list[int] = []

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self._seq.append(token)
            if len(self._seq) >= self.n:
                self.add(self._seq[-self.n :])

    def add(self, gram: list[int]) -> None:
        """Remember one n-gram (n tokens): its last n-1 tokens become a candidate after its first."""
        gram = tuple(gram)
        bucket = self._pool[gram[0]]
        if gram[1:] in bucket:
            bucket.remove(gram[1:])
        bucket.appendleft(gram[1:])

    def propose(self, root: int, trie: TokenTrie) -> None:
        # The paper's pool is unranked: candidates are taken as they come, here the most recent first.
        for gram in list(self._pool.get(root, ()))[: self.candidates]:
            trie.add_path(list(gram), [1.0] * len(gram), "ngram")
