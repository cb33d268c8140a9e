"""accept() and TokenTrie on hand-built blocks, plus properties over random trees (no model, no network)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from splitinfer.decoding.draft import MAX_STEP_PROB, Draft, TokenTrie, accept

VOCAB = 16


def greedy(row: torch.Tensor) -> int:
    return int(row.argmax())


def logits_with_argmax(argmaxes: list[int], vocab: int = VOCAB) -> torch.Tensor:
    """[q, vocab] logits whose row r has its unique maximum at argmaxes[r] (noise below it so other entries differ)."""
    g = torch.Generator().manual_seed(len(argmaxes))
    out = torch.rand(len(argmaxes), vocab, generator=g)  # values in [0, 1)
    for r, t in enumerate(argmaxes):
        out[r, t] = 5.0
    return out


# ---------------------------------------------------------------- accept on hand-built blocks


def test_chain_all_drafts_match_accepts_every_row_and_takes_next_from_last_row():
    tokens, parents = [10, 1, 2, 3], [-1, 0, 1, 2]
    logits = logits_with_argmax([1, 2, 3, 7])
    path, nxt = accept(tokens, parents, logits, greedy)
    assert path == [0, 1, 2, 3]
    assert nxt == 7


def test_chain_rejected_at_first_draft_returns_root_only():
    tokens, parents = [10, 1, 2, 3], [-1, 0, 1, 2]
    # Rows 1..3 would all match their children, but row 0 already disagrees with draft 1.
    logits = logits_with_argmax([5, 2, 3, 7])
    path, nxt = accept(tokens, parents, logits, greedy)
    assert path == [0]
    assert nxt == 5


def test_chain_rejected_midway_stops_at_the_mismatch():
    tokens, parents = [10, 1, 2, 3], [-1, 0, 1, 2]
    logits = logits_with_argmax([1, 9, 3, 7])
    path, nxt = accept(tokens, parents, logits, greedy)
    assert path == [0, 1]
    assert nxt == 9


def test_tree_second_child_accepted_path_is_not_a_block_prefix():
    #        0 (root 10)
    #       / \
    #  1 (1)   2 (2)
    #     |     |
    #  3 (3)   4 (4)
    tokens, parents = [10, 1, 2, 3, 4], [-1, 0, 0, 1, 2]
    # Row 1's argmax (3) would match its child, but row 1 is never reached.
    logits = logits_with_argmax([2, 3, 4, 0, 9])
    path, nxt = accept(tokens, parents, logits, greedy)
    assert path == [0, 2, 4]
    assert nxt == 9


def test_tree_first_child_branch_when_root_prefers_it():
    tokens, parents = [10, 1, 2, 3, 4], [-1, 0, 0, 1, 2]
    logits = logits_with_argmax([1, 3, 4, 11, 9])
    path, nxt = accept(tokens, parents, logits, greedy)
    assert path == [0, 1, 3]
    assert nxt == 11


def test_no_drafts_returns_root_and_argmax_of_row_zero():
    logits = logits_with_argmax([6])
    path, nxt = accept([10], [-1], logits, greedy)
    assert path == [0]
    assert nxt == 6


def test_sampling_choose_is_followed_whatever_it_picks():
    tokens, parents = [10, 1, 2, 3, 4], [-1, 0, 0, 1, 2]
    # The logits' argmax points down the left branch; the chooser ignores it.
    logits = logits_with_argmax([1, 3, 4, 11, 9])
    script = iter([2, 4, 6])
    seen: list[torch.Tensor] = []

    def choose(row: torch.Tensor) -> int:
        seen.append(row)
        return next(script)

    path, nxt = accept(tokens, parents, logits, choose)
    assert path == [0, 2, 4]
    assert nxt == 6
    # choose saw exactly the rows of the accepted path, in order.
    assert len(seen) == 3
    for row, r in zip(seen, [0, 2, 4]):
        assert torch.equal(row, logits[r])


def test_sampling_choose_that_rejects_everything_stops_at_root():
    tokens, parents = [10, 1, 2], [-1, 0, 0]
    logits = logits_with_argmax([1, 0, 0])
    path, nxt = accept(tokens, parents, logits, lambda row: 15)
    assert (path, nxt) == ([0], 15)


# ---------------------------------------------------------------- accept properties over random trees


@st.composite
def random_blocks(draw):
    nodes = draw(st.integers(0, 12))
    vocab = draw(st.integers(2, 6))  # a small vocabulary so drafts often match by chance
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, nodes + 1)]
    tokens = [draw(st.integers(0, vocab - 1)) for _ in range(nodes + 1)]
    seed = draw(st.integers(0, 2**31 - 1))
    logits = torch.randn(nodes + 1, vocab, generator=torch.Generator().manual_seed(seed))
    return tokens, parents, logits


@settings(max_examples=200, deadline=None)
@given(random_blocks())
def test_accept_path_is_a_greedy_root_to_node_path(block):
    tokens, parents, logits = block
    path, nxt = accept(tokens, parents, logits, greedy)
    argmax = logits.argmax(dim=-1).tolist()
    assert path[0] == 0
    assert len(set(path)) == len(path)
    for prev, row in zip(path, path[1:]):
        assert parents[row] == prev  # a root-to-node path in the tree
        assert tokens[row] == argmax[prev]  # each accepted draft is what its parent row predicts
    last = path[-1]
    assert nxt == argmax[last]
    children_tokens = {tokens[r] for r in range(1, len(tokens)) if parents[r] == last}
    assert nxt not in children_tokens  # otherwise the walk would have continued


def oracle(seq: list[int], vocab: int) -> int:
    """The 'model': the next token is a fixed function of the whole sequence so far."""
    h = 0
    for t in seq:
        h = (h * 1_000_003 + t + 1) % (1 << 61)
    return h % vocab


@st.composite
def oracle_blocks(draw):
    vocab = draw(st.integers(2, 8))
    context = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=5))
    nodes = draw(st.integers(0, 12))
    tokens, parents = [context[-1]], [-1]
    prefix = {0: list(context)}  # block row -> the sequence that ends with that row's token
    for i in range(1, nodes + 1):
        parent = draw(st.integers(0, i - 1))
        # Half the time draft what the oracle would say, so long accepted paths are common.
        if draw(st.booleans()):
            token = oracle(prefix[parent], vocab)
        else:
            token = draw(st.integers(0, vocab - 1))
        tokens.append(token)
        parents.append(parent)
        prefix[i] = prefix[parent] + [token]
    # Row r predicts what follows the path ending at r: one-hot at oracle(path to r).
    logits = torch.zeros(nodes + 1, vocab)
    for r in range(nodes + 1):
        logits[r, oracle(prefix[r], vocab)] = 1.0
    return context, tokens, parents, logits, vocab


@settings(max_examples=200, deadline=None)
@given(oracle_blocks())
def test_accept_emits_exactly_what_sequential_greedy_decoding_would(block):
    context, tokens, parents, logits, vocab = block
    path, nxt = accept(tokens, parents, logits, greedy)
    emitted = [tokens[r] for r in path[1:]] + [nxt]
    seq = list(context)
    sequential = []
    for _ in range(len(emitted)):
        t = oracle(seq, vocab)
        sequential.append(t)
        seq.append(t)
    assert emitted == sequential


def test_oracle_blocks_do_accept_long_paths():
    """Guard the property above against vacuity: a block built entirely from oracle drafts is accepted whole."""
    vocab, context = 7, [3, 1]
    tokens, parents, seq = [context[-1]], [-1], list(context)
    for i in range(1, 6):
        t = oracle(seq, vocab)
        tokens.append(t)
        parents.append(i - 1)
        seq.append(t)
    logits = torch.zeros(6, vocab)
    for r in range(6):
        logits[r, oracle(context + tokens[1 : r + 1], vocab)] = 1.0
    path, nxt = accept(tokens, parents, logits, greedy)
    assert path == [0, 1, 2, 3, 4, 5]
    assert nxt == oracle(seq, vocab)


# ---------------------------------------------------------------- Draft


def test_draft_block_puts_root_first():
    d = Draft(tokens=[4, 5, 6], parents=[0, 1, 0], scores=[0.9, 0.5, 0.1])
    assert len(d) == 3
    assert d.block(99) == ([99, 4, 5, 6], [-1, 0, 1, 0])
    assert Draft().block(7) == ([7], [-1])


# ---------------------------------------------------------------- TokenTrie


def test_add_path_merges_shared_prefixes_and_keeps_max_path_product():
    trie = TokenTrie()
    trie.add_path([1, 2, 3], [0.5, 0.5, 0.5])
    trie.add_path([1, 2, 4], [0.9, 0.1, 1.0])
    assert len(trie) == 4  # 1, 2 shared; 3 and 4 are siblings
    n1 = trie.children[0][1]
    n2 = trie.children[n1][2]
    n3, n4 = trie.children[n2][3], trie.children[n2][4]
    assert trie.parent[n1] == 0 and trie.parent[n2] == n1 and trie.parent[n3] == n2 and trie.parent[n4] == n2
    assert trie.token[n3] == 3 and trie.token[n4] == 4
    assert trie.score[n1] == 0.9  # max(0.5, 0.9)
    assert trie.score[n2] == 0.25  # max(0.5*0.5, 0.9*0.1=0.09)
    assert trie.score[n3] == 0.125  # 0.5**3
    assert abs(trie.score[n4] - 0.9 * 0.1 * MAX_STEP_PROB) < 1e-12  # a step probability of 1.0 is capped
    # A path that only lowers scores changes nothing.
    trie.add_path([1, 2], [0.1, 0.1])
    assert len(trie) == 4 and trie.score[n1] == 0.9 and trie.score[n2] == 0.25


def test_best_zero_or_negative_budget_and_empty_trie_are_empty():
    trie = TokenTrie()
    assert len(trie.best(5)) == 0
    trie.add_path([1, 2], [0.5, 0.5])
    assert len(trie.best(0)) == 0
    assert len(trie.best(-3)) == 0


def test_best_hand_built_picks_highest_scores_in_bfs_order():
    trie = TokenTrie()
    trie.add_path([1, 2, 3], [0.9, 0.9, 0.9])  # 0.9, 0.81, 0.729
    trie.add_path([5, 6], [0.8, 0.1])  # 0.8, 0.08
    trie.add_path([7], [0.05])
    d = trie.best(4)
    # Top four scores: 1 (0.9), 5 (0.8), 2 (0.81), 3 (0.729); BFS: depth 1 first, then by insertion.
    assert d.tokens == [1, 5, 2, 3]
    assert d.parents == [0, 0, 1, 3]
    assert d.scores == [0.9, 0.8, 0.9 * 0.9, 0.9 * 0.9 * 0.9]
    assert len(trie.best(100)) == 6


def test_best_includes_ancestors_when_a_child_reported_more_than_its_parent():
    trie = TokenTrie()
    trie.add_path([1, 2], [0.1, 5.0])  # child's path product 0.5 > parent's 0.1 (e.g. a weight > 1)
    trie.add_path([3], [0.3])
    for budget in (1, 2, 3):
        d = trie.best(budget)
        assert len(d) == budget
        assert all(0 <= p <= i for i, p in enumerate(d.parents))  # parent row < own row (rows are i + 1)
    assert trie.best(1).tokens == [3]
    d2 = trie.best(2)
    assert d2.tokens == [1, 3] and d2.parents == [0, 0]
    d3 = trie.best(3)
    assert d3.tokens == [1, 3, 2] and d3.parents == [0, 0, 1]
    assert d3.scores[2] <= d3.scores[0]  # the child's score is clamped to its parent's


def test_a_confident_copy_takes_the_budget_before_likelier_head_nodes_and_proposers_are_kept():
    trie = TokenTrie()
    trie.add_path([1, 2], [0.9, 0.8], "head")  # 0.9, 0.72
    trie.add_path([4, 5, 6], [0.8, 0.9, 0.9], "suffix")  # 0.8, 0.72, 0.648
    trie.add_path([1], [0.3], "recycling")  # a token the head proposed too, less likely by the table
    assert trie.best(3).tokens == [1, 4, 2]  # by score alone
    first = trie.best(3, ("suffix", "recycling"), 0.5)
    assert first.tokens == [4, 5, 6]  # the copy's three nodes, all at least 0.5 likely
    assert trie.best(4, ("suffix", "recycling"), 0.5).tokens == [1, 4, 5, 6]
    assert trie.best(3, ("suffix", "recycling"), 0.75).tokens == [1, 4, 2]  # only the copy's first node is confident
    draft = trie.best(5)
    assert draft.sources[draft.tokens.index(1)] == "head"  # the likelier source scores the node
    assert draft.proposers[draft.tokens.index(1)] == ("head", "recycling")
    assert draft.proposers[draft.tokens.index(2)] == ("head",)


@st.composite
def random_tries(draw):
    paths = draw(
        st.lists(
            st.lists(st.tuples(st.integers(0, 4), st.floats(0.01, 1.0)), min_size=1, max_size=5),
            min_size=0,
            max_size=8,
        )
    )
    budget = draw(st.integers(0, 30))
    return paths, budget


@settings(max_examples=200, deadline=None)
@given(random_tries())
def test_best_is_a_connected_bfs_tree_of_the_top_scoring_nodes(case):
    paths, budget = case
    trie = TokenTrie()
    for p in paths:
        trie.add_path([t for t, _ in p], [q for _, q in p])
    nodes = len(trie)
    # Independent reference: each node's effective score is the minimum raw score along its path.
    raw = list(trie.score)
    eff = [1.0] * len(raw)
    depth = [0] * len(raw)
    for n in range(1, len(raw)):
        eff[n] = min(raw[n], eff[trie.parent[n]])
        depth[n] = depth[trie.parent[n]] + 1
    by_path = {}
    for n in range(1, len(raw)):
        seq, m = [], n
        while m:
            seq.append(trie.token[m])
            m = trie.parent[m]
        by_path[tuple(reversed(seq))] = n

    d = trie.best(budget)
    assert len(d) == min(max(budget, 0), nodes)
    assert len(d.parents) == len(d.tokens) == len(d.scores)
    # Reconstruct each draft node's token path and map it back to a trie node.
    row_path = {0: ()}
    chosen = []
    for i, (tok, par) in enumerate(zip(d.tokens, d.parents)):
        row = i + 1
        assert 0 <= par < row  # parent already emitted: connected, parent index < own row
        row_path[row] = row_path[par] + (tok,)
        chosen.append(by_path[row_path[row]])
    assert len(set(chosen)) == len(chosen)
    # BFS order: depths never decrease.
    assert [depth[n] for n in chosen] == sorted(depth[n] for n in chosen)
    # Scores reported are the effective ones, and the set is the top by effective score.
    assert d.scores == [eff[n] for n in chosen]
    excluded = set(range(1, len(raw))) - set(chosen)
    if chosen and excluded:
        assert min(eff[n] for n in chosen) >= max(eff[n] for n in excluded)


@settings(max_examples=200, deadline=None)
@given(random_tries(), st.floats(0.0, 1.0))
def test_nodes_put_first_still_make_a_connected_tree_and_come_before_the_rest(case, confident):
    paths, budget = case
    trie = TokenTrie()
    for i, p in enumerate(paths):
        trie.add_path([t for t, _ in p], [q for _, q in p], "copy" if i % 2 else "head")
    d = trie.best(budget, ("copy",), confident)
    assert len(d) == min(max(budget, 0), len(trie))
    assert all(0 <= par <= i for i, par in enumerate(d.parents))
    row_node = {0: 0}
    for i, (tok, par) in enumerate(zip(d.tokens, d.parents)):
        row_node[i + 1] = trie.children[row_node[par]][tok]
    chosen = set(row_node.values()) - {0}
    ahead = {n for n in range(1, len(trie.token)) if trie.proposed[n].get("copy", 0.0) >= confident}
    assert chosen >= ahead or chosen <= ahead  # the confident nodes fill the budget before any other


def test_side_rows_see_the_root_and_their_chain_and_no_tree_row_sees_them():
    from splitinfer.decoding.draft import SideRows, block_layout
    from splitinfer.masks import tree_allowed

    parents = [-1, 0, 0, 1]  # root, two children, a grandchild
    side = SideRows(tokens=[7, 8, 9], depths=[1, 2, 2], sees=[[0], [0, 1], [0, 2]])
    allowed, depths = block_layout(parents, side)
    assert allowed.shape == (7, 7)
    assert (allowed[:4, :4] == tree_allowed(parents)).all()
    assert not allowed[:4, 4:].any()  # the tree's logits cannot depend on side rows
    assert allowed[4].tolist() == [True, False, False, False, True, False, False]
    assert allowed[6].tolist() == [True, False, False, False, True, False, True]
    assert depths == [0, 1, 1, 2, 1, 2, 2]


def test_lookahead_window_rows_form_chains_of_consecutive_positions():
    import torch

    from splitinfer.decoding.strategies import Lookahead, LookaheadConfig

    strategy = Lookahead(LookaheadConfig(ngram=4, candidates=2, window=3))
    prompt = list(range(10, 30))
    strategy.start(prompt, torch.zeros(1, 50))
    draft = strategy.propose(prompt)
    side = draft.side
    assert len(side.tokens) == 3 * 3
    for row, seen in enumerate(side.sees):
        # A row sees a chain at depths 1..its own depth, one row per depth, itself last.
        assert sorted(side.depths[j] for j in seen) == list(range(1, side.depths[row] + 1))
        assert row in seen
    # After a step every column becomes a 4-gram in the pool, keyed on its level-0 guess.
    q = 1 + len(draft) + len(side.tokens)
    logits = torch.zeros(q, 50)
    logits[:, 42] = 1.0  # the model predicts 42 everywhere
    level0 = list(strategy.levels[0])
    strategy.observe([prompt[-1]] + draft.tokens, [-1] + draft.parents, logits, [0], [42], 10.0)
    for col, first in enumerate(level0):
        assert any(gram[-1] == 42 for gram in strategy.pool._pool[first])
    # The window slid by one emitted token and kept its shape.
    assert [len(level) for level in strategy.levels] == [3, 3, 3]
