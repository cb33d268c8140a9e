"""The learned draft head as a tree source: greedy output stays sequential's, and its cache follows the context."""

from __future__ import annotations

import pytest
import torch

from splitinfer.decoding.calibration import Ratio
from splitinfer.decoding.draft import Draft, TokenTrie
from splitinfer.decoding.headsource import HeadDraftConfig, HeadDrafter
from splitinfer.decoding.strategies import Tree, TreeConfig
from splitinfer.clients import open_client
from splitinfer.local.config import ClientConfig
from splitinfer.local.client import load_draft_head
from splitinfer.local.session import SplitSession
from splitinfer.model.drafthead import DRAFTER_DIR, HeadCache, load_head
from splitinfer.model.manifest import model_identity

from tiny import prepare_tiny, random_head

PROMPT = [3, 17, 42, 5, 88, 21, 9, 60, 33, 7, 14, 2, 71]


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_tree_with_a_random_head_is_token_identical_to_sequential(tmp_path, family):
    _, shards = prepare_tiny(tmp_path, family, 1, 1)
    client = open_client(local_only=True, shards=shards)
    expected = client.generate(PROMPT, max_new_tokens=24, stop_ids=set(), strategy="sequential").token_ids
    tree = Tree(TreeConfig(fixed_nodes=12), head=random_head(client.local, vocab=64))
    got = client.generate(PROMPT, max_new_tokens=24, stop_ids=set(), strategy=tree)
    assert got.token_ids == expected
    assert tree.drafter.drafted > 0
    # Caught up, the head's cache holds one pair per committed row it has seen, up to the last root.
    tree.drafter.catch_up()
    assert not tree.drafter.backlog and tree.drafter.cache.length == tree.drafter.position


def test_incremental_cache_equals_one_pass(tmp_path):
    _, shards = prepare_tiny(tmp_path, "llama", 1, 1)
    local = open_client(local_only=True, shards=shards).local
    head = random_head(local)
    d = local.config.hidden_size
    tokens = [5, 9, 1, 44, 7, 3, 80, 12, 6, 30]
    features = torch.randn(len(tokens), d)
    stepwise = HeadDrafter(head, HeadDraftConfig(max_nodes=8))
    stepwise.start(tokens[:4], features[:4])
    stepwise.propose(tokens[4], TokenTrie())  # the root's pair joins the cache
    stepwise.observe(features[4:7], tokens[5:8])  # root + 2 accepted drafts, then the next root
    assert stepwise.cache.length == 4 and len(stepwise.backlog) == 1  # waits for the next draft
    stepwise.catch_up()
    whole = HeadDrafter(head)
    whole.start(tokens[:8], features[:8])
    whole.propose(tokens[8], TokenTrie())
    assert stepwise.cache.length == whole.cache.length - 1 == 7
    torch.testing.assert_close(stepwise.cache.keys, whole.cache.keys[:, :, :7], rtol=1e-4, atol=1e-5)


def test_steps_that_draft_nothing_wait_in_the_backlog_and_enter_the_cache_in_one_pass(tmp_path):
    """Pairs observed (and the root synced) on steps that draft nothing with the head stay out of the cache
    until the next `propose`, which runs the head over all of them at once: the cache it leaves is the one
    catching up after every step gives."""
    _, shards = prepare_tiny(tmp_path, "llama", 1, 1)
    local = open_client(local_only=True, shards=shards).local
    head = random_head(local)
    tokens = [5, 9, 1, 44, 7, 3, 80, 12, 6, 30, 2]
    features = torch.randn(len(tokens), local.config.hidden_size, generator=torch.Generator().manual_seed(1))
    lazy, eager = HeadDrafter(head), HeadDrafter(head)
    for drafter in (lazy, eager):
        drafter.start(tokens[:4], features[:4])
        drafter.sync(tokens[4])  # a step that drafts nothing with the head
    eager.catch_up()
    for start, end in ((4, 7), (7, 8), (8, 10)):  # three steps: the accepted paths' rows and next tokens
        for drafter in (lazy, eager):
            drafter._nodes = []
            drafter.observe(features[start:end], tokens[start + 1 : end + 1])
        eager.catch_up()
    assert lazy.cache.length == 3 and len(lazy.backlog) == 4  # the prompt's pairs only, so far
    lazy.propose(tokens[10], TokenTrie())
    assert not lazy.backlog and lazy.cache.length == lazy.position == eager.cache.length == 10
    torch.testing.assert_close(lazy.cache.keys, eager.cache.keys, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lazy.tip, eager.tip, rtol=1e-4, atol=1e-5)


def test_propose_builds_a_bounded_tree_with_conditional_probabilities(tmp_path):
    _, shards = prepare_tiny(tmp_path, "llama", 1, 1)
    local = open_client(local_only=True, shards=shards).local
    drafter = HeadDrafter(random_head(local), HeadDraftConfig(top_k=3, beam=2, max_depth=4, max_nodes=10, min_path_prob=0.0))
    drafter.start(PROMPT, torch.randn(len(PROMPT), local.config.hidden_size))
    trie = TokenTrie()
    assert drafter.propose(4, trie) == 10 == len(trie)
    depth = [0] * len(trie.token)
    for n in range(1, len(trie.token)):
        depth[n] = depth[trie.parent[n]] + 1
        assert trie.source[n] == "head" and 0 < trie.score[n] <= trie.score[trie.parent[n]]
    assert 1 < max(depth) <= 4


def test_head_saves_loads_and_installs_for_its_model_only(tmp_path):
    _, shards = prepare_tiny(tmp_path, "llama", 1, 1)
    client = open_client(local_only=True, shards=shards)
    head = random_head(client.local, vocab=50)
    directory = shards / "local" / DRAFTER_DIR
    head.save(directory, extra={"model_fingerprint": model_identity(client.local.manifest)})
    loaded = load_head(directory, client.local.embed, client.local.norm, client.local.lm_head)
    x, tokens = torch.randn(1, 3, client.local.config.hidden_size), torch.tensor([[4, 5, 6]])
    allowed = torch.ones(3, 3, dtype=torch.bool).tril()
    expected = head.logits(head(x, tokens, torch.arange(3), allowed)[0])
    torch.testing.assert_close(loaded.logits(loaded(x, tokens, torch.arange(3), allowed)[0]), expected, rtol=0.05, atol=0.05)
    assert torch.equal(loaded.draft_vocab, torch.arange(50))
    assert open_client(local_only=True, shards=shards).draft_head is not None
    assert open_client(local_only=True, shards=shards, config=ClientConfig(drafter="off")).draft_head is None
    head.save(directory, extra={"model_fingerprint": "another model"})
    assert load_draft_head(client.local, shards / "local", "auto") is None


def test_the_tree_drafts_with_the_head_only_when_it_pays_and_still_explores(tmp_path):
    _, shards = prepare_tiny(tmp_path, "llama", 1, 1)
    tree = Tree(TreeConfig(head_explore_every=4), head=random_head(open_client(local_only=True, shards=shards).local))
    assert tree._head_pays()  # the priors try the head first
    tree.head_value.ms_per_token = Ratio(1.0, 1.0, prior_ratio=0.01)  # a fast verifier: a drafted token is worth 0.01 ms
    # Explorations after 4 steps, then 8, 16...: each that still finds the head not paying doubles the gap.
    explored = [tree._head_pays() for _ in range(4 + 8 + 16)]
    assert [i for i, drafted in enumerate(explored) if drafted] == [3, 11, 27]
    tree.head_value.ms_per_token = Ratio(1.0, 1.0, prior_ratio=500.0)  # a slow link: every head token is worth drafting
    assert all(tree._head_pays() for _ in range(5))


def test_unlikely_nodes_are_not_expanded_and_tested_nodes_calibrate_their_depth(tmp_path):
    _, shards = prepare_tiny(tmp_path, "llama", 1, 1)
    local = open_client(local_only=True, shards=shards).local
    features = torch.randn(len(PROMPT) + 8, local.config.hidden_size)
    drafter = HeadDrafter(random_head(local), HeadDraftConfig(top_k=3, beam=2, max_depth=4, max_nodes=10, min_path_prob=1.0))
    drafter.start(PROMPT, features[: len(PROMPT)])
    assert drafter.propose(4, TokenTrie()) == 3  # the root's children only: none is certain enough to expand
    first = max(drafter._nodes[:3], key=lambda n: n.raw)
    assert first.key == (1, True)
    before = drafter._ratio((1, True)).value
    # The emitted token is the head's first choice: that node hit, its siblings missed.
    drafter.observe(features[len(PROMPT) : len(PROMPT) + 2], [first.token, 9])
    assert drafter._ratio((1, True)).value > before
    assert drafter._ratio((1, False)).value < before
    assert drafter._nodes == []  # each tree teaches once


def _chain_distribution(head, cache, position, tip, tokens):
    """The head's next-token distribution after the pairs along `tokens` (depth order) below the tip, one
    row at a time over a copy of the committed cache: the straightforward reference for tree drafting."""
    cache = HeadCache(cache.keys, cache.values)
    feature = tip
    for depth, token in enumerate(tokens):
        allowed = torch.ones(1, cache.length + 1, dtype=torch.bool)
        predicted, keys, values = head(feature[None, None], torch.tensor([[token]]), torch.tensor([position + depth]),
                                       allowed, cache)
        cache.extend(keys, values)
        feature = predicted[0, 0]
    return torch.softmax(head.logits(feature), dim=-1)


def test_tree_drafting_equals_the_head_run_along_each_path(tmp_path):
    """Tree attention (every expanded node of a level in one pass, grouped-query heads folded into rows)
    gives each node the token and probability that running the head along its path alone gives."""
    _, shards = prepare_tiny(tmp_path, "llama", 1, 1)
    local = open_client(local_only=True, shards=shards).local
    head = random_head(local, vocab=64)
    assert head.config.num_heads > head.config.num_kv_heads  # the grouped-query path is exercised
    drafter = HeadDrafter(head, HeadDraftConfig(top_k=3, beam=2, max_depth=4, max_nodes=20, min_path_prob=0.0))
    drafter.start(PROMPT, torch.randn(len(PROMPT), local.config.hidden_size))
    drafter.propose(4, TokenTrie())
    nodes = drafter._nodes
    assert max(node.depth for node in nodes) == 4
    for i, node in enumerate(nodes):
        ancestors, parent = [], node.parent
        while parent >= 0:
            ancestors.insert(0, nodes[parent].token)
            parent = nodes[parent].parent
        probs = _chain_distribution(head, drafter.cache, drafter.position, drafter.tip, ancestors)
        siblings = [n for n in nodes if n.parent == node.parent]
        rank = siblings.index(node)
        assert int(head.draft_vocab[probs.topk(3).indices[rank]]) == node.token, (i, node)
        assert abs(probs[node.token].item() - node.raw) < 1e-5


def test_the_head_is_credited_only_with_accepted_tokens_no_other_source_proposed(tmp_path):
    _, shards = prepare_tiny(tmp_path, "llama", 1, 1)
    tree = Tree(TreeConfig(), head=random_head(open_client(local_only=True, shards=shards).local))
    tree._drafted = True
    tree.last_draft = Draft(tokens=[5, 6, 7], parents=[0, 1, 2], scores=[0.9, 0.8, 0.7], sources=["head"] * 3,
                            keys=[None] * 3, proposers=[("head", "suffix"), ("head",), ("head",)])
    before = tree.head_value.head_yield.accepted
    tree._learn_head_value([0, 1, 2], rows=4, step_ms=100.0, emitted=3)  # rows 1 and 2 accepted, row 3 not
    assert tree.head_value.head_yield.accepted - 0.9 * before == pytest.approx(1.0)  # row 2 only: row 1 the suffix index proposed too


def test_the_head_is_charged_its_drafting_and_the_verification_of_the_rows_only_it_proposed(tmp_path):
    _, shards = prepare_tiny(tmp_path, "llama", 1, 1)
    tree = Tree(TreeConfig(), head=random_head(open_client(local_only=True, shards=shards).local))
    for rows, ms in [(1, 50.0)] * 3 + [(5, 70.0), (9, 90.0)] * 3:  # one row 50 ms, then 50 + 5 ms a row
        tree.controller.costs.add(rows, ms, explore_rows=16)
    assert tree.controller.block_ms(1) == 50.0 and tree.controller.block_ms(9) == pytest.approx(90.0)
    # Four nodes: two only the head proposed (both accepted), one both, one only the suffix index.
    tree.last_draft = Draft(tokens=[5, 6, 7, 8], parents=[0, 1, 0, 3], scores=[0.5] * 4,
                            proposers=[("head",), ("head",), ("head", "suffix"), ("suffix",)])
    tree._drafted, tree._draft_ms = True, 7.0
    value = tree.head_value
    value.cost, value.head_yield = Ratio(0.0, 1.0), Ratio(0.0, 1.0)  # no prior: only this step counts
    tree._learn_head_value([0, 1, 2], rows=5, step_ms=80.0, emitted=3)
    # 5 rows cost 70 ms, the 3 rows without the head's two 60 ms: 7 ms drafting + 10 ms verifying.
    assert value.cost.value == pytest.approx(17.0)
    assert value.head_yield.value == pytest.approx(2.0)  # rows 1 and 2, both the head's alone
    assert tree.report() == {"draft_head": {"steps": 1, "rows": 2, "tokens": 2, "ms": 7.0, "ahead": 0, "ahead_used": 0,
                                            "ahead_ms": 0.0}}


def test_a_generation_reports_what_the_head_did(tmp_path):
    _, shards = prepare_tiny(tmp_path, "llama", 1, 1)
    client = open_client(local_only=True, shards=shards)
    tree = Tree(TreeConfig(fixed_nodes=8), head=random_head(client.local, vocab=64))
    stats = client.generate(PROMPT, max_new_tokens=24, stop_ids=set(), strategy=tree).stats
    head = stats["draft_head"]
    assert 0 < head["steps"] <= stats["steps"] and head["rows"] <= 8 * head["steps"] and head["ms"] > 0
    assert head["tokens"] <= min(head["rows"], stats["generated_tokens"] - 1)
    second = client.generate(PROMPT, max_new_tokens=4, stop_ids=set(), strategy=tree).stats["draft_head"]
    assert second["steps"] <= 4  # counted per generation
    assert "draft_head" not in client.generate(PROMPT, max_new_tokens=4, strategy="tree-nohead").stats


def test_what_the_head_is_worth_carries_over_to_the_next_generation_of_the_same_client(tmp_path):
    from splitinfer.decoding.controller import StepCosts

    _, shards = prepare_tiny(tmp_path, "llama", 1, 1)
    head, costs = random_head(open_client(local_only=True, shards=shards).local), StepCosts()
    first = Tree(TreeConfig(), costs=costs, head=head)
    assert first._head_pays()  # the priors try the head first
    for _ in range(30):  # it never brought a token, and each drafting step cost 40 ms
        first.head_value.observe_drafting(0, 40.0)
    second = Tree(TreeConfig(head_explore_every=4), costs=costs, head=head)
    assert [second._head_pays() for _ in range(4)] == [False, False, False, True]  # only exploration
    assert Tree(TreeConfig(), head=head)._head_pays()  # another client starts from the priors


def test_a_fused_head_drafts_from_the_states_of_the_committed_rows(tmp_path):
    """A fused head (sent state 1, received state 5 of the tiny split) in the tree: greedy output stays
    sequential's, and its cache equals one pass of the head over the committed rows with their true states
    (what training feeds it); the same rows without the states give another cache."""
    _, shards = prepare_tiny(tmp_path, "llama", 1, 1)
    client = open_client(local_only=True, shards=shards)
    expected = client.generate(PROMPT, max_new_tokens=24, stop_ids=set(), strategy="sequential").token_ids
    head = random_head(client.local, vocab=64, fused_layers=(1, 5))
    tree = Tree(TreeConfig(fixed_nodes=12), head=head)
    assert client.generate(PROMPT, max_new_tokens=24, stop_ids=set(), strategy=tree).token_ids == expected
    assert tree.drafter.drafted > 0
    text = PROMPT + expected  # the last block may have accepted rows past the token limit: more pairs
    pairs = len(text) - 1
    tree.drafter.catch_up()
    assert tree.drafter.cache.length >= pairs
    with SplitSession(client.local, client.make_middle(), client.config) as session:
        session.prefill(text)
        rows = session.features((1, 5))
    assert rows.shape == (len(text), 3 * client.local.config.hidden_size)
    whole = HeadDrafter(head)
    whole.start(text, rows)
    torch.testing.assert_close(tree.drafter.cache.keys[:, :, :pairs], whole.cache.keys, rtol=1e-4, atol=1e-4)
    blind = HeadDrafter(head)
    d = client.local.config.hidden_size
    blind.start(text, torch.cat([rows[:, :d], torch.zeros_like(rows[:, d:])], dim=-1))
    assert not torch.allclose(blind.cache.keys, whole.cache.keys, rtol=1e-3, atol=1e-3)


def _chain_features(head, cache, position, tip, tokens):
    """The head's own predictions of the features of the rows along `tokens` below the tip (the tip first),
    one row at a time over a copy of the committed cache."""
    cache, features = HeadCache(cache.keys, cache.values), [tip]
    for depth, token in enumerate(tokens):
        allowed = torch.ones(1, cache.length + 1, dtype=torch.bool)
        predicted, keys, values = head(features[-1][None, None], torch.tensor([[token]]),
                                       torch.tensor([position + depth]), allowed, cache)
        cache.extend(keys, values)
        features.append(predicted[0, 0])
    return torch.stack(features)


def _drafted(config, local, head, root):
    drafter = HeadDrafter(head, config)
    drafter.start(PROMPT, torch.randn(len(PROMPT), local.config.hidden_size, generator=torch.Generator().manual_seed(1)))
    drafter.propose(root, TokenTrie())
    return drafter


def test_a_tree_drafted_ahead_is_the_tree_the_head_would_grow_on_its_own_predictions(tmp_path):
    """`draft_ahead` assumes a prefix of the block's path kept and a token after it, and grows the tree that
    `propose` grows once the head has seen its own predicted features for those rows; the committed state is
    left untouched. The outcome it picks is the likeliest by reach times the head's chance, never a token the
    block already carried below that row."""
    _, shards = prepare_tiny(tmp_path, "llama", 1, 1)
    local = open_client(local_only=True, shards=shards).local
    head = random_head(local, vocab=64)
    config = HeadDraftConfig(top_k=3, beam=2, max_depth=3, max_nodes=12, min_path_prob=0.0)
    drafter = _drafted(config, local, head, 4)
    before = (drafter.cache.length, drafter.position, drafter.tip.clone(), list(drafter._nodes))
    path, reach = [11, 23, 35], [0.9, 0.8, 0.7]
    features = _chain_features(head, drafter.cache, drafter.position, drafter.tip, path)
    probs = torch.softmax(head.logits(features), dim=-1)
    taken = [{int(head.draft_vocab[probs[0].argmax()])}, set(), set(), set()]  # the head's first choice at the root was sent
    ahead = drafter.draft_ahead(path, reach, taken)
    assert (drafter.cache.length, drafter.position, drafter._nodes) == before[:2] + (before[3],)
    torch.testing.assert_close(drafter.tip, before[2])
    scores = [max(p for t, p in enumerate(row.tolist()) if t not in taken[j]) * (1.0 if j == 0 else reach[j - 1])
              for j, row in enumerate(probs)]
    kept = max(range(len(scores)), key=lambda j: scores[j])
    assert kept > 0  # the truncated chain is exercised: row 0's first choice was taken
    assert ahead.kept == path[:kept] and ahead.score == pytest.approx(scores[kept], rel=1e-5)
    assert ahead.root not in taken[kept] and ahead.root == int(probs[kept].argsort(descending=True)[int(kept == 0)])
    # The same tree from a drafter that observed those rows with the head's predicted features:
    reference = _drafted(config, local, head, 4)
    reference._nodes = []  # nothing to calibrate from: the ratios stay those the ahead tree was drafted with
    reference.observe(features[: kept + 1], [*path[:kept], ahead.root])
    reference.propose(ahead.root, TokenTrie())
    assert [(n.token, n.parent, n.depth) for n in ahead.nodes] == [(n.token, n.parent, n.depth) for n in reference._nodes]
    for mine, theirs in zip(ahead.nodes, reference._nodes):
        assert mine.raw == pytest.approx(theirs.raw, abs=1e-5)


def test_a_tree_used_ahead_takes_its_first_level_from_the_true_features(tmp_path):
    """Where the assumed outcome came, `propose_ahead` reads the first level from the head's prediction on
    the true features (what `propose` would add first) and keeps the ahead tree's deeper nodes only below the
    first-level tokens both share."""
    _, shards = prepare_tiny(tmp_path, "llama", 1, 1)
    local = open_client(local_only=True, shards=shards).local
    head = random_head(local, vocab=64)
    config = HeadDraftConfig(top_k=3, beam=3, max_depth=3, max_nodes=40, min_path_prob=0.0)
    drafter = _drafted(config, local, head, 4)
    predicted = _chain_features(head, drafter.cache, drafter.position, drafter.tip, [11])
    ahead = drafter.draft_ahead([11], [0.9], [set(), set()])
    # the true features near the head's predictions: the first levels share some tokens, not all
    true_features = predicted[: len(ahead.kept) + 1] + 0.3 * torch.randn(len(ahead.kept) + 1, local.config.hidden_size,
                                                                           generator=torch.Generator().manual_seed(2))
    drafter.observe(true_features, [*ahead.kept, ahead.root])
    drafter.catch_up()  # what propose_ahead does first
    fresh = HeadDrafter(head, config)
    fresh.cache, fresh.position, fresh.tip = HeadCache(drafter.cache.keys, drafter.cache.values), drafter.position, drafter.tip
    fresh.propose(ahead.root, TokenTrie())
    trie = TokenTrie()
    drafter.propose_ahead(ahead, ahead.root, trie)
    nodes = drafter._nodes
    first = [(n.token, n.raw) for n in nodes if n.depth == 1]
    assert first == [(n.token, n.raw) for n in fresh._nodes if n.depth == 1]
    ahead_below = {}  # (first-level token, path below it) of every deeper ahead node
    for node in ahead.nodes:
        ahead_below[id(node)] = [node.token] if node.depth == 1 else ahead_below[id(ahead.nodes[node.parent])] + [node.token]
    grafted = set(tuple(p) for p in ahead_below.values() if p[0] in {t for t, _ in first})
    for i, node in enumerate(nodes):
        path, j = [], i
        while j >= 0:
            path.insert(0, nodes[j].token)
            j = nodes[j].parent
        assert len(path) == 1 or tuple(path) in grafted
        assert 0 < node.path_prob <= (1.0 if node.parent < 0 else nodes[node.parent].path_prob)
    assert len(trie) == min(len(nodes), config.max_nodes) and any(n.depth > 1 for n in nodes)


def test_the_tree_drafts_ahead_only_while_that_hides_in_the_wait(tmp_path):
    """A tree drafted ahead costs the client time while its block is out; where the last one took more than
    `ahead_share` of a step of the block's rows (a short wait: a fast cloud, no round trip), none is drafted
    until skipped steps have counted that cost down below it (a one-off cost does not end drafting ahead)."""
    _, shards = prepare_tiny(tmp_path, "llama", 1, 1)
    local = open_client(local_only=True, shards=shards).local
    tree = Tree(TreeConfig(), head=random_head(local, vocab=64))
    tree.start(PROMPT, torch.randn(1, local.config.vocab_size))
    tree.see_features(torch.randn(len(PROMPT), local.config.hidden_size))
    draft = tree.propose(PROMPT)
    step = tree.controller.block_ms(len(draft) + 1)
    tree._ahead_ms = 0.6 * step
    tree.draft_ahead(PROMPT, draft)
    assert tree._ahead is None and tree.report()["draft_head"]["ahead"] == 0
    skipped = 1
    while tree._ahead is None:  # each skipped step counts the last cost down, until it is tried again
        tree.draft_ahead(PROMPT, draft)
        skipped += tree._ahead is None
    assert skipped == 2 and tree.report()["draft_head"]["ahead"] == 1  # 0.6 -> 0.54 -> 0.486 of a step
