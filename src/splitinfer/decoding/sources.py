"""Where draft tokens come from. Each source adds candidate continuations of the context to a TokenTrie.

- `SuffixIndex`: the longest suffix of the context that occurred before (in the prompt, the output so
  far, earlier outputs) and what followed it, with frequencies (the idea of SuffixDecoding / prompt
  lookup, kept as an n-gram position index).
- `ReplyStore`: the same lookup, read-only and compact, over the model's own replies to offline prompts
  (built offline and shipped with the successor table, warm.py): what other replies said after the same
  words.
- `TokenRecycling`: for every token, the top-k successors the model predicted the last time that token
  was an input row, with their probabilities; recorded from logits rows the LM head computes anyway.
- `NgramPool`: the original paper's lookahead pool: n-grams keyed on a single token, most recent first.

Sources only propose; checking is the verifier's job. `Occurrences` is what the suffix lookup reads from
an index of earlier text, whichever it is (this text, earlier outputs, the shipped replies).
"""

from __future__ import annotations

import array
import bisect
import heapq
import itertools
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from .. import kernels
from .calibration import prior_continue_prob
from .draft import TokenTrie


# Suffix and reply-store continuations are cut where their path probability falls below this.
MIN_PATH_PROB = 0.01


class Occurrences(Protocol):
    """An index of earlier token sequences that `propose_suffix` looks a suffix up in (SuffixIndex, ReplyStore)."""

    max_match: int  # the longest n-gram it can match

    def occurrences(self, ngram: tuple[int, ...]) -> list[tuple[list[int], int]]:
        """(sequence, end) of occurrences of `ngram` that something followed: sequence[end] came next."""
        ...


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


class ReplyStore:
    """Replies searchable by suffix like a SuffixIndex, but read-only and compact: the positions of every
    reply token, sorted once by the `max_match` tokens from there (a suffix array cut at max_match), and
    found by bisection. A frequent n-gram occurs thousands of times, so a lookup returns an evenly spaced
    sample of at most `max_occurrences` of them: sorted by what follows, the sample keeps the shares of
    the continuations.
    """

    def __init__(self, docs: list[list[int]], order: list[int] | None = None, max_match: int = 8,
                 max_occurrences: int = 64):
        """`order`: the positions sorted as `self.order` holds them (numbered through the docs in turn),
        as saved with the table; computed when not given."""
        self.docs = docs
        self.max_match = max_match
        self.max_occurrences = max_occurrences
        self._starts = list(itertools.accumulate((len(d) for d in docs), initial=0))
        # Every reply's tokens in one list, and where each position's reply ends: an n-gram is one slice.
        self._flat = [token for doc in docs for token in doc]
        self._ends = array.array("l", (end for start, end in itertools.pairwise(self._starts) for _ in range(start, end)))
        self.order = order if order is not None else sorted(range(self._starts[-1]), key=lambda i: self._ngram(i, max_match))

    def _ngram(self, i: int, n: int) -> list[int]:
        return self._flat[i : min(i + n, self._ends[i])]

    def occurrences(self, ngram: tuple[int, ...]) -> list[tuple[list[int], int]]:
        """(reply, end) of up to `max_occurrences` occurrences of `ngram` that something followed."""
        n, key = len(ngram), list(ngram)
        lo = bisect.bisect_left(self.order, key, key=lambda i: self._ngram(i, n))
        hi = bisect.bisect_right(self.order, key, lo=lo, key=lambda i: self._ngram(i, n))
        # Occurrences that end a reply sort first (nothing follows them): skip past them.
        lo = bisect.bisect_right(self.order, key, lo=lo, hi=hi, key=lambda i: self._ngram(i, n + 1))
        step = max(1.0, (hi - lo) / self.max_occurrences)
        found = []
        for k in range(min(hi - lo, self.max_occurrences)):
            i = self.order[lo + int(k * step)]
            doc = bisect.bisect_right(self._starts, i) - 1
            found.append((self.docs[doc], i - self._starts[doc] + n))
        return found


def propose_suffix(
    indexes: Sequence[Occurrences], context: list[int], trie: TokenTrie, max_depth: int,
    continue_prob: Callable[[int], float] = prior_continue_prob, max_occurrences: int = 64,
    fallback: Sequence[Occurrences] = (),
) -> int:
    """Continuations of the context's suffix over several indexes at once (this text, earlier outputs).

    Occurrences of a match in every index count together, later indexes as the more recent ones. The
    longest match counts most, but shorter matches add their (other) occurrences too, with less
    confidence: a single long match gives one path, and the tree wants alternatives below it. `fallback`
    indexes (the shipped replies) are searched only at match lengths where `indexes` have no occurrence,
    so what this text said after the same words is not outvoted by what other texts did. Returns the
    longest match length.
    """
    seen: set[tuple[int, int]] = set()
    longest = 0
    max_match = max(index.max_match for index in (*indexes, *fallback))
    for n in range(min(max_match, len(context)), 0, -1):
        key = tuple(context[-n:])
        found = [(seq, end) for index in indexes for seq, end in index.occurrences(key)]
        found = found or [(seq, end) for index in fallback for seq, end in index.occurrences(key)]
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
    """Insert what followed the occurrences, grouped token by token: a node's conditional probability is
    continue_prob(L) x (occurrences through it / occurrences through its parent). A branch stops where its
    path probability would fall below MIN_PATH_PROB: no block sends such a node, and a reply store's
    sixty-four continuations would otherwise insert a thousand of them a step."""

    def grow(path: list[int], probs: list[float], path_prob: float, group: list) -> None:
        children: dict[int, list] = {}
        if len(path) < max_depth:
            for seq, pos in group:
                if pos < len(seq):
                    children.setdefault(seq[pos], []).append((seq, pos + 1))
        factor = continue_prob(matched + len(path)) if children else 0.0
        grew = False
        for token, members in children.items():
            p = factor * len(members) / len(group)
            if path_prob * p >= MIN_PATH_PROB:
                grew = True
                grow(path + [token], probs + [p], path_prob * p, members)
        if path and not grew:  # a leaf: its prefixes go in with it
            trie.add_path(path, probs, "suffix", [("suffix", matched + d) for d in range(len(path))])

    grow([], [], 1.0, list(occurrences))


class TokenRecycling:
    """Top-k successors per token with probabilities, refreshed from every logits row computed."""

    def __init__(self, k: int = 8):
        self.k = k
        self._next: dict[int, tuple[list[int], list[float]]] = {}
        self._row_top = kernels.runs("row_top") and k <= 64  # kernels/row_top.cpp, chosen once


    def observe(self, tokens: list[int], logits: torch.Tensor) -> None:
        """tokens: the block's input tokens; logits: [q, vocab], row r predicts what follows tokens[r].
        kernels/row_top.cpp where it runs (k up to 64): one read of a row for its top k, one for the softmax's sum."""
        if self._row_top and logits.dtype == torch.float32 and logits.device.type == "cpu":
            ids, ps = torch.ops.splitinfer.row_top(logits.contiguous(), self.k)
        else:
            top = torch.softmax(logits.float(), dim=-1).topk(self.k, dim=-1)
            ids, ps = top.indices, top.values
        ids, ps = ids.tolist(), ps.tolist()
        for r, token in enumerate(tokens):
            self._next[token] = (ids[r], ps[r])

    def warm(self, successors: dict[int, tuple[list[int], list[float]]]) -> None:
        """Start from a table built offline (warm.py) instead of empty; what this text shows replaces it."""
        self._next.update(successors)

    def propose(self, root: int, trie: TokenTrie, max_nodes: int, max_depth: int, weight: float = 1.0) -> None:
        """Best-first expansion from the root token through the successor table (a max-heap on path probability).

        Each step's probability is the table's p times `weight` (the calibrated trust in this source); each
        node's key ("recycling", p) keeps the uncalibrated p for calibration.py to learn from. A token's
        successors are stored most likely first, so a node's next sibling joins the heap only when the node
        leaves it (nothing below it could leave first): about two pushes a node rather than k.
        """
        counter = itertools.count()  # tie-breaker: heapq never compares the rest
        # (-path priority, tie, the parent's trie node, its path probability, depth, successors, index among them)
        frontier: list = []

        def push_first(node: int, prob: float, path_prob: float, depth: int, token: int) -> None:
            if depth < max_depth and token in self._next:
                successors = self._next[token]
                heapq.heappush(frontier, (-prob * successors[1][0] * weight, next(counter), node, prob, path_prob,
                                          depth, successors, 0))

        push_first(0, 1.0, 1.0, 0, root)
        for _ in range(max_nodes):
            if not frontier:
                break
            neg, _, parent, parent_prob, parent_path, depth, (ids, ps), i = heapq.heappop(frontier)
            if i + 1 < len(ids):  # the next sibling, the likeliest left among this parent's successors
                heapq.heappush(frontier, (-parent_prob * ps[i + 1] * weight, next(counter), parent, parent_prob,
                                          parent_path, depth, (ids, ps), i + 1))
            p = ps[i]
            node, path_prob = trie.add_child(parent, parent_path, ids[i], p * weight, "recycling", ("recycling", p))
            push_first(node, -neg, path_prob, depth + 1, ids[i])


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
