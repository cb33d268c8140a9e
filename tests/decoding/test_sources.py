"""Draft sources: SuffixIndex, TokenRecycling and the lookahead NgramPool, on hand-made inputs."""

from __future__ import annotations

import pytest

from splitinfer.decoding.draft import MAX_STEP_PROB
import torch

from splitinfer.decoding.draft import TokenTrie
from splitinfer.decoding.sources import NgramPool, SuffixIndex, TokenRecycling


def trie_paths(trie: TokenTrie) -> dict[tuple[int, ...], float]:
    """Every node of the trie as its token path from the root -> score."""
    out = {}
    for n in range(1, len(trie.token)):
        seq, m = [], n
        while m:
            seq.append(trie.token[m])
            m = trie.parent[m]
        out[tuple(reversed(seq))] = trie.score[n]
    return out


def max_depth(trie: TokenTrie) -> int:
    return max((len(p) for p in trie_paths(trie)), default=0)


# ---------------------------------------------------------------- SuffixIndex


def test_suffix_index_proposes_both_continuations_of_the_match():
    index = SuffixIndex()
    index.add_doc([1, 2, 3, 4, 1, 2, 3, 5])
    trie = TokenTrie()
    n = index.propose([9, 1, 2, 3], trie, max_depth=1)
    assert n == 3  # (9, 1, 2, 3) never occurred; (1, 2, 3) did, twice
    paths = trie_paths(trie)
    assert set(paths) == {(4,), (5,)}
    # Matched 3 tokens: the prior says a copy goes on with 3 / (3 + 2); each token took 1 of 2 occurrences.
    assert paths[(4,)] == pytest.approx(0.6 * 1 / 2)
    assert paths[(5,)] == pytest.approx(0.6 * 1 / 2)


def test_suffix_index_deeper_continuations_follow_the_document():
    index = SuffixIndex()
    index.add_doc([1, 2, 3, 4, 1, 2, 3, 5])
    trie = TokenTrie()
    assert index.propose([9, 1, 2, 3], trie, max_depth=3) == 3
    # After end 3 comes 4, 1, 2; after end 7 only 5 (the document ends).
    assert set(trie_paths(trie)) == {(4,), (4, 1), (4, 1, 2), (5,)}


def test_suffix_index_more_frequent_continuation_scores_higher():
    index = SuffixIndex()
    index.add_doc([1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 5])
    trie = TokenTrie()
    assert index.propose([9, 1, 2, 3], trie, max_depth=1) == 3
    paths = trie_paths(trie)
    assert paths[(4,)] > paths[(5,)]
    assert paths[(4,)] == pytest.approx(0.6 * 2 / 3)
    assert paths[(5,)] == pytest.approx(0.6 * 1 / 3)


def test_suffix_index_never_uses_the_occurrence_at_the_end_of_the_context():
    index = SuffixIndex()
    doc = [5, 6, 7, 8]
    index.add_doc(doc)
    trie = TokenTrie()
    assert index.propose(doc, trie, max_depth=4) == 0  # the only occurrence is the context itself
    assert len(trie) == 0


def test_suffix_index_falls_back_to_shorter_earlier_match():
    index = SuffixIndex()
    doc = [1, 2, 3, 4, 1, 2, 3]
    index.add_doc(doc)
    trie = TokenTrie()
    # The whole doc (length 7) only occurs at its own end; (1, 2, 3) also occurred at position 3.
    assert index.propose(doc, trie, max_depth=2) == 3
    assert set(trie_paths(trie)) == {(4,), (4, 1)}


def test_suffix_index_extend_makes_new_tokens_visible():
    index = SuffixIndex()
    doc = index.add_doc([1, 2, 3])
    trie = TokenTrie()
    assert index.propose([1, 2, 3], trie, max_depth=2) == 0
    index.extend(doc, [7, 1, 2, 3])
    assert index.docs[doc] == [1, 2, 3, 7, 1, 2, 3]
    trie = TokenTrie()
    assert index.propose([1, 2, 3, 7, 1, 2, 3], trie, max_depth=2) == 3
    assert set(trie_paths(trie)) == {(7,), (7, 1)}


def test_suffix_index_searches_across_documents():
    index = SuffixIndex()
    index.add_doc([4, 5, 6, 9])
    current = index.add_doc([0, 4, 5, 6])
    trie = TokenTrie()
    assert index.propose(index.docs[current], trie, max_depth=3) == 3
    assert set(trie_paths(trie)) == {(9,)}


def test_suffix_index_max_depth_limits_depth():
    index = SuffixIndex()
    index.add_doc([1, 2] + list(range(10, 30)) + [1, 2])
    for depth in (1, 2, 5):
        trie = TokenTrie()
        assert index.propose([1, 2], trie, max_depth=depth) == 2
        assert max_depth(trie) == depth
        assert len(trie) == depth  # one chain
        assert list(trie_paths(trie)) == [tuple(range(10, 10 + d)) for d in range(1, depth + 1)]


def test_suffix_index_confidence_grows_along_a_copy():
    index = SuffixIndex()
    index.add_doc([1, 2] + list(range(10, 20)))
    trie = TokenTrie()
    assert index.propose([1, 2], trie, max_depth=4) == 2
    paths = trie_paths(trie)
    # One occurrence: each node's conditional is continue_prob(L) with L = 2, 3, 4, 5 tokens matched.
    expected, path_prob = {}, 1.0
    for d, length in enumerate((2, 3, 4, 5), start=1):
        path_prob *= length / (length + 2)
        expected[tuple(range(10, 10 + d))] = path_prob
    assert paths == pytest.approx(expected)


def test_suffix_index_uses_the_given_continue_prob_and_labels_nodes_with_their_match_length():
    index = SuffixIndex()
    index.add_doc([1, 2, 3, 7, 8, 9])
    trie = TokenTrie()
    index.propose([5, 2, 3], trie, max_depth=3, continue_prob=lambda length: 0.5 if length < 4 else 0.9)
    assert trie_paths(trie) == pytest.approx({(7,): 0.5, (7, 8): 0.25, (7, 8, 9): 0.225})
    # Matched (2, 3): the node after it has matched 2 tokens, its child 3, and so on.
    by_token = dict(zip(trie.token[1:], trie.key[1:]))
    assert by_token == {7: ("suffix", 2), 8: ("suffix", 3), 9: ("suffix", 4)}


def test_suffix_index_max_match_caps_match_length():
    index = SuffixIndex(max_match=2)
    index.add_doc([1, 2, 3, 4, 1, 2, 3])
    assert index.propose([1, 2, 3, 4, 1, 2, 3], TokenTrie(), max_depth=1) == 2


def test_suffix_index_scores_are_monotone_along_paths():
    index = SuffixIndex()
    index.add_doc([1, 2, 3, 4, 5, 1, 2, 3, 4, 6, 1, 2, 3, 7, 1, 2, 3])
    trie = TokenTrie()
    index.propose([1, 2, 3], trie, max_depth=3)
    for n in range(1, len(trie.token)):
        assert 0.0 < trie.score[n] <= trie.score[trie.parent[n]]


# ---------------------------------------------------------------- TokenRecycling

V = 40


def row_with_probs(spec: dict[int, float], vocab: int = V) -> torch.Tensor:
    """A logits row whose softmax is exactly `spec` on its tokens, the rest spread evenly over the others."""
    p = torch.zeros(vocab, dtype=torch.float64)
    rest = [t for t in range(vocab) if t not in spec]
    for t, v in spec.items():
        p[t] = v
    p[rest] = (1.0 - sum(spec.values())) / len(rest)
    return p.log()


def test_recycling_observe_stores_top_k_successors_with_softmax_probabilities():
    rec = TokenRecycling(k=3)
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, -1.0], [5.0, 0.0, 0.0, 0.0, 4.0]])
    rec.observe([7, 8], logits)
    trie = TokenTrie()
    rec.propose(7, trie, max_nodes=10, max_depth=1)
    probs = torch.softmax(logits[0], dim=-1)
    paths = trie_paths(trie)
    assert set(paths) == {(3,), (2,), (1,)}  # top 3 of row 0
    for t in (3, 2, 1):
        assert paths[(t,)] == pytest.approx(float(probs[t]), rel=1e-6)
    # The first level arrives in descending order of probability.
    assert [trie.token[n] for n in range(1, 4)] == [3, 2, 1]


def test_recycling_later_observation_replaces_earlier():
    rec = TokenRecycling(k=1)
    rec.observe([7], torch.tensor([[0.0, 9.0, 0.0]]))
    rec.observe([7], torch.tensor([[0.0, 0.0, 9.0]]))
    trie = TokenTrie()
    rec.propose(7, trie, max_nodes=4, max_depth=1)
    assert set(trie_paths(trie)) == {(2,)}


def test_recycling_expands_through_the_table_to_the_depth_limit():
    rec = TokenRecycling(k=2)
    # 0 -> 1 (0.6) / 2 (0.3); 1 -> 3 (0.5) / 4 (0.4); 3 -> 5 (0.9) / 6 (0.05)
    rows = [row_with_probs({1: 0.6, 2: 0.3}), row_with_probs({3: 0.5, 4: 0.4}), row_with_probs({5: 0.9, 6: 0.05})]
    rec.observe([0, 1, 3], torch.stack(rows))
    trie = TokenTrie()
    rec.propose(0, trie, max_nodes=100, max_depth=2)
    paths = trie_paths(trie)
    assert set(paths) == {(1,), (2,), (1, 3), (1, 4)}  # 3's successors are at depth 3
    assert paths[(1, 3)] == pytest.approx(0.3)
    assert paths[(1, 4)] == pytest.approx(0.24)
    trie = TokenTrie()
    rec.propose(0, trie, max_nodes=100, max_depth=3)
    assert set(trie_paths(trie)) == {(1,), (2,), (1, 3), (1, 4), (1, 3, 5), (1, 3, 6)}


def test_recycling_node_limit_takes_best_first():
    rec = TokenRecycling(k=2)
    rows = [row_with_probs({1: 0.6, 2: 0.3}), row_with_probs({3: 0.5, 4: 0.4}), row_with_probs({5: 0.9, 6: 0.05})]
    rec.observe([0, 1, 3], torch.stack(rows))
    # Path probabilities: 1 0.6, 2 0.3, 1-3 0.3, 1-3-5 0.27, 1-4 0.24, 1-3-6 0.015
    expected_order = [(1,), (2,), (1, 3), (1, 3, 5), (1, 4), (1, 3, 6)]
    for budget in range(0, 7):
        trie = TokenTrie()
        rec.propose(0, trie, max_nodes=budget, max_depth=5)
        assert len(trie) == budget
        got = set(trie_paths(trie))
        # Ties (2 and 1-3 at 0.3) may come in either order; compare as sets around them.
        if budget == 2:
            assert got in ({(1,), (2,)}, {(1,), (1, 3)})
        else:
            assert got == set(expected_order[:budget])


def test_recycling_unknown_root_adds_nothing():
    rec = TokenRecycling(k=2)
    rec.observe([0], torch.stack([row_with_probs({1: 0.6, 2: 0.3})]))
    trie = TokenTrie()
    rec.propose(99, trie, max_nodes=10, max_depth=5)
    assert len(trie) == 0


def test_recycling_weight_scales_probabilities():
    rec = TokenRecycling(k=2)
    rec.observe([0], torch.stack([row_with_probs({1: 0.6, 2: 0.3})]))
    trie = TokenTrie()
    rec.propose(0, trie, max_nodes=10, max_depth=1, weight=0.5)
    paths = trie_paths(trie)
    assert paths[(1,)] == pytest.approx(0.3) and paths[(2,)] == pytest.approx(0.15)


def _frontier_case() -> TokenRecycling:
    # Root 0: child 1 (0.5) and seven leaves 2..8 (0.07 each, no successors recorded).
    # 1 -> 9 (0.9) + 7 low leaves; 9 -> 17 (0.9) + 7 low leaves; 17 -> 18 (0.5), 19 (0.4) + 6 low leaves.
    rows = [
        row_with_probs({1: 0.5, **{t: 0.07 for t in range(2, 9)}}),
        row_with_probs({9: 0.9, **{t: 0.01 for t in range(10, 17)}}),
        row_with_probs({17: 0.9, **{t: 0.01 for t in range(20, 27)}}),
        row_with_probs({18: 0.5, 19: 0.4, **{t: 0.015 for t in range(27, 33)}}),
    ]
    rec = TokenRecycling(k=8)
    rec.observe([0, 1, 9, 17], torch.stack(rows))
    return rec


def test_recycling_is_best_first_even_when_the_frontier_is_full():
    rec = _frontier_case()
    trie = TokenTrie()
    rec.propose(0, trie, max_nodes=5, max_depth=10)
    # Best five paths: 1 (0.5), 1-9 (0.45), 1-9-17 (0.405), 1-9-17-18 (0.2025), 1-9-17-19 (0.162);
    # every other candidate is at most 0.07.
    assert set(trie_paths(trie)) == {(1,), (1, 9), (1, 9, 17), (1, 9, 17, 18), (1, 9, 17, 19)}


def _full_frontier_propose(table, root, trie, max_nodes, max_depth, weight):
    """Best-first over the successor table pushing every successor of a node at once, each path inserted
    whole: what TokenRecycling.propose did before it pushed a node's next sibling only as the node left."""
    import heapq
    import itertools

    counter = itertools.count()
    frontier, added = [(-1.0, next(counter), [root], [])], 0
    while frontier and added < max_nodes:
        neg_prob, _, path, probs = heapq.heappop(frontier)
        if len(path) > 1:
            trie.add_path(path[1:], [p * weight for p in probs], "recycling", [("recycling", p) for p in probs])
            added += 1
        if len(path) - 1 >= max_depth or path[-1] not in table:
            continue
        for token, p in zip(*table[path[-1]]):
            heapq.heappush(frontier, (neg_prob * p * weight, next(counter), path + [token], probs + [p]))


@pytest.mark.parametrize("weight", [0.4, 1.0, 2.0])
def test_recycling_pushing_siblings_one_at_a_time_builds_the_same_trie(weight):
    gen = torch.Generator().manual_seed(int(weight * 10))
    rec = TokenRecycling(k=6)
    for token in range(30):  # successors most likely first, as observe and the shipped table store them
        ps = torch.rand(6, generator=gen, dtype=torch.float64).sort(descending=True).values / 2
        rec._next[token] = (torch.randint(0, 30, (6,), generator=gen).tolist(), ps.tolist())
    for root in range(5):
        for nodes, depth in ((1, 1), (7, 3), (48, 12), (200, 5)):
            got, want = TokenTrie(), TokenTrie()
            rec.propose(root, got, nodes, depth, weight)
            _full_frontier_propose(rec._next, root, want, nodes, depth, weight)
            assert (got.token, got.parent, got.score, got.key, got.proposed) == (
                want.token, want.parent, want.score, want.key, want.proposed)


# ---------------------------------------------------------------- NgramPool


def pool_paths(pool: NgramPool, root: int) -> tuple[list[tuple[int, ...]], dict[tuple[int, ...], float]]:
    """(the candidates proposed for `root` as leaf paths in insertion order, every node's path -> score)."""
    trie = TokenTrie()
    pool.propose(root, trie)
    paths = trie_paths(trie)
    path_of = {n: p for n, p in enumerate(paths, start=1)}  # trie_paths walks nodes in index order
    leaves = [path_of[n] for n in range(1, len(trie.token)) if not trie.children[n]]
    return leaves, paths


def test_ngram_pool_keys_on_first_token_most_recent_first():
    pool = NgramPool(n=3, candidates=5)
    pool.extend([1, 2, 3, 1, 4, 5])
    # 3-grams: (1,2,3) (2,3,1) (3,1,4) (1,4,5); keyed on 1: (4,5) newest, then (2,3).
    assert list(pool._pool[1]) == [(4, 5), (2, 3)]
    leaves, paths = pool_paths(pool, 1)
    assert leaves == [(4, 5), (2, 3)]  # each candidate is n-1 tokens, most recent first
    assert all(len(p) == 2 for p in leaves)
    # the pool is unranked: every step has the same (capped) probability, so scores depend on depth only
    assert all(score == MAX_STEP_PROB ** len(path) for path, score in paths.items())
    assert pool_paths(pool, 2)[0] == [(3, 1)]
    assert pool_paths(pool, 5)[0] == []  # nothing started with 5 yet


def test_ngram_pool_duplicate_moves_to_front_without_repeating():
    pool = NgramPool(n=3, candidates=5)
    pool.extend([1, 2, 3, 1, 4, 5, 1, 2, 3])
    assert list(pool._pool[1]) == [(2, 3), (4, 5)]
    assert pool_paths(pool, 1)[0] == [(2, 3), (4, 5)]


def test_ngram_pool_proposes_at_most_candidates_and_keeps_pool_size():
    pool = NgramPool(n=2, candidates=2, pool_size=3)
    pool.extend([0, 1, 0, 2, 0, 3, 0, 4])
    assert list(pool._pool[0]) == [(4,), (3,), (2,)]  # oldest (1,) fell out of the size-3 pool
    leaves, _ = pool_paths(pool, 0)
    assert leaves == [(4,), (3,)]


def test_ngram_pool_needs_n_tokens_before_any_gram():
    pool = NgramPool(n=4, candidates=5)
    pool.extend([1, 2, 3])
    assert pool_paths(pool, 1)[0] == []
    pool.extend([4])  # grams also form across extend() calls
    assert pool_paths(pool, 1)[0] == [(2, 3, 4)]


# ---------------------------------------------------------------- Tree strategy state


def _tree_observe(tree, root: int, emitted: list[int], vocab: int = 16) -> None:
    """One verified step with no draft: root in, `emitted` out."""
    tree.observe([root], [-1], torch.zeros(1, vocab), [0], emitted, 100.0)


def test_tree_kept_across_generations_searches_the_earlier_text():
    from splitinfer.decoding.strategies import Tree, TreeConfig

    tree = Tree(TreeConfig(fixed_nodes=4, prompt_rows=1))
    tree.start([1, 2, 3], torch.zeros(1, 16))
    tree.propose([1, 2, 3])
    _tree_observe(tree, 3, [4, 5, 6, 7])  # the first generation wrote 4 5 6 7 after 1 2 3
    # A second generation with the same strategy: its prompt ends like the first one did.
    tree.start([9, 2, 3], torch.zeros(1, 16))
    assert tree.index.docs[0] == [1, 2, 3, 4, 5, 6, 7]
    draft = tree.propose([9, 2, 3])
    assert draft.tokens[:4] == [4, 5, 6, 7]
    # A fresh strategy knows nothing of it.
    fresh = Tree(TreeConfig(fixed_nodes=4, prompt_rows=1))
    fresh.start([9, 2, 3], torch.zeros(1, 16))
    assert 4 not in fresh.propose([9, 2, 3]).tokens


def test_tree_memory_drops_the_oldest_generations_past_its_budget():
    from splitinfer.decoding.strategies import Tree, TreeConfig

    tree = Tree(TreeConfig(fixed_nodes=0, prompt_rows=1, memory_tokens=10))
    for first in range(5):
        tree.start([first, 100 + first, 200 + first, 300 + first], torch.zeros(1, 16))
    # Four earlier generations of 4 tokens each: only the two newest fit in 10 tokens.
    assert tree.earlier == [[2, 102, 202, 302], [3, 103, 203, 303]]
