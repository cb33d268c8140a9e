"""Warm starts: the successor table (build, save, load, match by fingerprint) and the replies shipped with
it, the bounded suffix memory, and that they leave greedy output token-identical to sequential while changing what is drafted."""

from __future__ import annotations

import json

import pytest
import torch

from splitinfer.decoding.draft import TokenTrie
from splitinfer.decoding.sources import MIN_PATH_PROB, ReplyStore, SuffixIndex, propose_suffix
from splitinfer.decoding.strategies import Tree, TreeConfig
from splitinfer.decoding.warm import (
    RecyclingTable, SuffixMemory, aggregate_successors, shipped_recycling_table,
)
from splitinfer.errors import ConfigError
from splitinfer.clients import open_client

from decoding.test_sources import trie_paths
from tiny import prepare_tiny

PROMPT = [3, 17, 42, 5, 88, 21, 9, 60, 33, 7, 14, 2, 71] * 2 + [3, 17]


def test_aggregate_averages_each_tokens_distribution_over_its_occurrences():
    logits = torch.full((3, 6), -30.0)
    logits[0, 4] = logits[1, 4] = 10.0  # token 1 -> 4, twice
    logits[2, 5] = 10.0  # token 2 -> 5
    table, seen = aggregate_successors([([1, 1, 2], logits[:3]), ([1], torch.tensor([[-30.0] * 5 + [10.0]]))], k=2)
    assert seen == {1: 3, 2: 1}
    ids, ps = table[1]
    assert ids[:2] == [4, 5] and ps[0] == pytest.approx(2 / 3, abs=1e-4) and ps[1] == pytest.approx(1 / 3, abs=1e-4)
    assert table[2][0][0] == 5 and table[2][1][0] == pytest.approx(1.0, abs=1e-4)


def test_table_round_trips_and_is_found_only_for_its_fingerprint(tmp_path):
    table = RecyclingTable({7: ([1, 2], [0.75, 0.25]), 9: ([3], [0.5])}, {"format": "splitinfer-recycling",
                                                                         "model_fingerprint": "abc"})
    table.save(tmp_path / "m")
    loaded = RecyclingTable.load(tmp_path / "m")
    assert loaded.successors == {7: ([1, 2], [0.75, 0.25]), 9: ([3], [0.5])}
    assert shipped_recycling_table("abc", [tmp_path / "m"]).successors == loaded.successors
    assert shipped_recycling_table("other", [tmp_path / "m"]) is None
    (tmp_path / "m" / "recycling.json").write_text(json.dumps({"format": "something else", "model_fingerprint": "abc"}))
    with pytest.raises(ConfigError, match="rebuild"):
        shipped_recycling_table("abc", [tmp_path / "m"])


def test_suffix_memory_keeps_the_newest_outputs_within_its_bound():
    memory = SuffixMemory(max_tokens=10)
    memory.add([1, 2, 3, 4])
    memory.add([5, 6, 7, 8])
    assert memory.tokens == 8
    memory.add([9, 10, 11])  # 11 > 10: the oldest output goes
    assert memory.index.docs == [[5, 6, 7, 8], [9, 10, 11]]
    assert memory.index.occurrences((1, 2)) == [] and memory.index.occurrences((6, 7))
    memory.add(list(range(20, 40)))  # longer than the bound on its own: its last 10 tokens
    assert memory.index.docs == [list(range(30, 40))]
    with pytest.raises(ConfigError):
        SuffixMemory(max_tokens=-1)


def test_suffix_proposals_count_occurrences_across_the_text_and_the_memory():
    text, memory = SuffixIndex(), SuffixIndex()
    text.add_doc([1, 2, 3, 4])
    memory.add_doc([1, 2, 3, 5])
    memory.add_doc([1, 2, 3, 5])
    trie = TokenTrie()
    assert propose_suffix((memory, text), [9, 1, 2, 3], trie, max_depth=1) == 3
    paths = trie_paths(trie)
    # Matched 3 tokens (prior 0.6); 5 followed in 2 of 3 occurrences, 4 in 1.
    assert paths[(5,)] == pytest.approx(0.6 * 2 / 3) and paths[(4,)] == pytest.approx(0.6 * 1 / 3)


def test_tree_drafts_from_the_memory_and_the_table_and_stays_exact(tmp_path):
    _, shards = prepare_tiny(tmp_path, "llama", 2, 1)
    client = open_client(local_only=True, shards=shards)
    longer = client.generate(PROMPT, max_new_tokens=40, stop_ids=set(), strategy="sequential").token_ids
    expected = longer[:30]
    cold = client.generate(PROMPT, max_new_tokens=30, stop_ids=set(), strategy=Tree(TreeConfig(fixed_nodes=8)))
    memory = SuffixMemory()
    memory.add(PROMPT[-2:] + longer)  # an earlier reply that went the same way, and further
    warm = client.generate(PROMPT, max_new_tokens=30, stop_ids=set(), strategy=Tree(TreeConfig(fixed_nodes=8), memory=memory))
    table = RecyclingTable({t: ([(t + 1) % 96], [0.9]) for t in range(96)}, {})  # a table that is always wrong
    misled = client.generate(PROMPT, max_new_tokens=30, stop_ids=set(),
                             strategy=Tree(TreeConfig(fixed_nodes=8), memory=memory, recycling_table=table))
    assert cold.token_ids == warm.token_ids == misled.token_ids == expected
    assert warm.stats["steps"] < cold.stats["steps"]  # the memory's copy was proposed and accepted
    # The memory's copy runs past the 30-token cap, so the last step accepted more than the caller got:
    # only tokens the caller got are counted.
    decode = [s for s in warm.steps if s["kind"] == "decode"]
    assert sum(s["accepted"] for s in decode) == len(warm.token_ids) - 1
    assert decode[-1]["accepted"] < decode[-1]["rows"]


def test_a_conversation_adds_each_reply_to_its_memory(tmp_path):
    _, shards = prepare_tiny(tmp_path, "llama", 2, 1)
    client = open_client(local_only=True, shards=shards)
    memory = SuffixMemory()
    with client.conversation("tree", memory=memory) as conversation:
        turn = conversation.send(PROMPT, 12, stop_ids=set())
    assert memory.index.docs == [turn.token_ids]
    with client.conversation("tree") as conversation:
        conversation.send(PROMPT, 12, stop_ids=set())  # no memory given: nothing kept anywhere
    assert memory.index.docs == [turn.token_ids]


def _positions(docs, found):
    return sorted((next(i for i, d in enumerate(docs) if d is seq), end) for seq, end in found)


def test_the_reply_store_finds_what_a_suffix_index_over_the_same_replies_finds():
    import random

    rng = random.Random(0)
    docs = [[rng.randrange(5) for _ in range(rng.randrange(0, 30))] for _ in range(25)]
    store, index = ReplyStore(docs, max_occurrences=10**6), SuffixIndex(8, 10**6)
    for doc in docs:
        index.add_doc(doc)
    checked = 0
    for n in range(1, 6):
        for _ in range(100):
            key = tuple(rng.randrange(5) for _ in range(n))
            found = _positions(docs, store.occurrences(key))
            assert found == _positions(index.docs, index.occurrences(key)), key
            checked += bool(found)
    assert checked > 150  # most keys occur: the comparison is not of empty lists


def test_a_capped_reply_lookup_keeps_the_shares_of_the_continuations():
    docs = [[1, 2, 7]] * 90 + [[1, 2, 8]] * 30 + [[1, 2]] * 5  # after (1, 2): 7 three times as often as 8
    store = ReplyStore(docs, max_occurrences=16)
    found = store.occurrences((1, 2))
    assert len(found) == 16 and [seq[end] for seq, end in found].count(7) == 12
    trie = TokenTrie()
    propose_suffix((store,), [5, 1, 2], trie, max_depth=4)
    paths = trie_paths(trie)
    assert paths[(7,)] == pytest.approx(3 * paths[(8,)])


def test_replies_are_searched_only_at_match_lengths_where_the_text_has_none():
    replies = ReplyStore([[1, 2, 3, 7]] * 10)
    quoted = SuffixIndex()
    quoted.add_doc([1, 2, 3, 9, 4, 1, 2, 3])  # this text said 9 after (1, 2, 3) once; ten replies said 7
    context = quoted.docs[0]
    trie = TokenTrie()
    propose_suffix((quoted,), context, trie, max_depth=1, fallback=(replies,))
    assert set(trie_paths(trie)) == {(9,)}
    pooled = TokenTrie()
    propose_suffix((replies, quoted), context, pooled, max_depth=1)
    assert set(trie_paths(pooled)) == {(7,), (9,)}  # pooled, the replies outvote the quote
    assert trie_paths(pooled)[(7,)] > trie_paths(pooled)[(9,)]
    partial = SuffixIndex()
    partial.add_doc([2, 3, 9, 5, 1, 2, 3])  # (2, 3) went on before, (1, 2, 3) did not
    trie = TokenTrie()
    assert propose_suffix((partial,), partial.docs[0], trie, max_depth=1, fallback=(replies,)) == 3
    assert set(trie_paths(trie)) == {(7,), (9,)}  # the replies at length 3, the text at 2


def test_suffix_continuations_stop_below_the_smallest_path_probability():
    index = SuffixIndex()
    index.add_doc([1, 2, 3, 4, 5, 6] + [1, 9] * 40)  # after 1: 2 once in 41 occurrences, 9 forty times
    trie = TokenTrie()
    propose_suffix((index,), [1], trie, max_depth=6, continue_prob=lambda length: 0.3)
    paths = trie_paths(trie)
    assert paths[(9,)] == pytest.approx(0.3 * 40 / 41) and (2,) not in paths  # 0.3 / 41 < MIN_PATH_PROB
    assert all(p >= MIN_PATH_PROB for p in paths.values())


def test_a_table_keeps_its_replies_and_the_tree_drafts_from_them(tmp_path):
    replies = [[5, 6, 7, 8], [1, 2, 3, 4, 11, 12], [1, 2, 3, 4, 11, 12]]
    table = RecyclingTable({}, {"format": "splitinfer-recycling", "model_fingerprint": "abc"}, ReplyStore(replies))
    table.save(tmp_path / "m")
    loaded = RecyclingTable.load(tmp_path / "m")
    assert loaded.replies.docs == replies and loaded.replies.order == table.replies.order
    RecyclingTable({}, {"format": "splitinfer-recycling"}).save(tmp_path / "bare")
    assert RecyclingTable.load(tmp_path / "bare").replies is None
    prompt = [40, 41, 1, 2, 3]
    for config, drafted in ((TreeConfig(fixed_nodes=6), True), (TreeConfig(fixed_nodes=6, reply_store=False), False)):
        tree = Tree(config, recycling_table=loaded)
        tree.start(prompt, torch.zeros(1, 64))
        draft = tree.propose(prompt)
        chains = set()
        for row in range(1, len(draft.tokens) + 1):  # block row -> the tokens from the root down to it
            chain, r = [], row
            while r:
                chain.insert(0, draft.tokens[r - 1])
                r = draft.parents[r - 1]
            chains.add(tuple(chain))
        assert ((4, 11, 12) in chains) == drafted, (config, draft.tokens)


def test_the_tree_with_replies_stays_exact(tmp_path):
    _, shards = prepare_tiny(tmp_path, "llama", 2, 1)
    client = open_client(local_only=True, shards=shards)
    longer = client.generate(PROMPT, max_new_tokens=40, stop_ids=set(), strategy="sequential").token_ids
    wrong = [[t, (t + 7) % 96, (t + 3) % 96] for t in longer]  # replies that mislead after every token
    table = RecyclingTable({}, {}, ReplyStore(wrong + [PROMPT[-2:] + longer]))
    out = client.generate(PROMPT, max_new_tokens=30, stop_ids=set(), strategy=Tree(TreeConfig(fixed_nodes=8), recycling_table=table))
    cold = client.generate(PROMPT, max_new_tokens=30, stop_ids=set(), strategy=Tree(TreeConfig(fixed_nodes=8)))
    assert out.token_ids == longer[:30] and out.stats["steps"] < cold.stats["steps"]
