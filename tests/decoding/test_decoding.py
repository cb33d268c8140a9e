"""Every strategy's greedy output equals sequential greedy output, token for token, with the right logprobs."""

from __future__ import annotations

import pytest
import torch

from splitinfer.cloud.server import ServerThread
from splitinfer.decoding.draft import Draft
from splitinfer.decoding.strategies import STRATEGIES, Lookahead, LookaheadConfig, Strategy, Tree, TreeConfig
from splitinfer.clients import open_client
from splitinfer.local.session import ClientConfig
from splitinfer.model.shards import load_cloud

from tiny import hf_greedy as reference, prepare_tiny

# Repetition in the prompt gives the suffix index and the n-gram pool something to find.
PROMPT = [3, 17, 42, 5, 88, 21, 9, 60, 33, 7, 14, 2, 71] * 3 + [3, 17]
NEW = 40


class Oracle(Strategy):
    """Knows the true continuation; puts a wrong sibling first so accepted rows are not a block prefix."""

    name = "oracle"

    def __init__(self, truth: list[int], depth: int = 3):
        self.truth, self.depth = truth, depth

    def propose(self, history):
        done = len(history) - len(PROMPT)  # tokens emitted so far; the root is truth[done - 1]
        nxt = self.truth[done : done + self.depth]
        if not nxt:
            return Draft()
        wrong = (nxt[0] + 1) % 96
        # rows: 1 = wrong sibling, 2 = right child, 3 = a decoy under the wrong one, 4.. = the right chain
        tokens = [wrong, nxt[0], (wrong + 5) % 96, *nxt[1:]]
        rows_of_truth = [2] + list(range(4, 4 + len(nxt) - 1))
        parents = [0, 0, 1] + rows_of_truth[:-1]
        return Draft(tokens=tokens, parents=parents, scores=[0.5] * len(tokens))


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_all_strategies_match_hf_greedy(tmp_path, family):
    model, shards = prepare_tiny(tmp_path, family, 2, 1)
    expected = reference(model, PROMPT, NEW)
    client = open_client(local_only=True, shards=shards)
    for name in STRATEGIES:
        got = client.generate(PROMPT, max_new_tokens=NEW, stop_ids=set(), strategy=name)
        assert got.token_ids == expected, name


def test_strategies_over_the_wire_with_rejections_and_compaction(tmp_path):
    model, shards = prepare_tiny(tmp_path, "llama", 2, 2)
    expected = reference(model, PROMPT, NEW)
    sequential = open_client(local_only=True, shards=shards).generate(PROMPT, max_new_tokens=NEW, stop_ids=set(), strategy="sequential")
    with ServerThread(load_cloud(shards / "cloud")) as server:
        client = open_client(shards / "local", server.url, ClientConfig(wire_dtype="float32"), allow_public_weights=True, checks=False)
        oracle = client.generate(PROMPT, max_new_tokens=NEW, stop_ids=set(), strategy=Oracle(expected))
        fixed = client.generate(PROMPT, max_new_tokens=NEW, stop_ids=set(), strategy=Tree(TreeConfig(fixed_nodes=12)))
        lookahead = client.generate(PROMPT, max_new_tokens=NEW, stop_ids=set(), strategy="lookahead")
        windowed = client.generate(
            PROMPT, max_new_tokens=NEW, stop_ids=set(), strategy=Lookahead(LookaheadConfig(ngram=4, window=5))
        )
    # The Jacobi window rides along as side rows of every block (1 root + 5 x 3 window rows at least).
    assert min(s["rows"] for s in windowed.steps if s["kind"] == "decode") >= 16
    for result in (oracle, fixed, lookahead, windowed):
        assert result.token_ids == expected
        # The logprob of every token comes from the row that predicted it, as in sequential decoding.
        assert torch.allclose(torch.tensor(result.logprobs), torch.tensor(sequential.logprobs), atol=1e-4)
    # The oracle's right branch is the second child: accepted rows are [0, 2, 4, ...], never a prefix.
    assert oracle.stats["mean_accepted_per_step"] > 3.0
    assert any(s["rows"] > 1 and s["accepted"] > 1 for s in oracle.steps)
    # Rejected nodes happen (the wrong sibling is always rejected) and the output is still exact.
    assert all(s["accepted"] < s["rows"] for s in oracle.steps if s["kind"] == "decode" and s["rows"] > 1)


def test_long_context_tree_matches_sequential(tmp_path):
    """4.5k tokens of context, tree strategy with forced drafts, float32 wire: identical to sequential."""
    _, shards = prepare_tiny(tmp_path, "qwen2", 2, 2)
    torch.manual_seed(1)
    prompt = torch.randint(0, 96, (4_500,)).tolist()
    local = open_client(local_only=True, shards=shards)
    expected = local.generate(prompt, max_new_tokens=24, stop_ids=set(), strategy="sequential").token_ids
    with ServerThread(load_cloud(shards / "cloud")) as server:
        client = open_client(shards / "local", server.url, ClientConfig(wire_dtype="float32"), allow_public_weights=True, checks=False)
        got = client.generate(prompt, max_new_tokens=24, stop_ids=set(), strategy=Tree(TreeConfig(fixed_nodes=16)))
    assert got.token_ids == expected
    decode = [s for s in got.steps if s["kind"] == "decode"]
    # Forced drafts: every block is the root and exactly 16 draft nodes.
    assert decode and all(s["rows"] == 1 + 16 for s in decode), [s["rows"] for s in decode]
    # 24 tokens are the prefill's first one plus 23 more; fewer than 23 steps means drafts were accepted.
    assert len(decode) == got.stats["steps"] < 23, got.stats
    assert 1 + sum(s["accepted"] for s in decode[:-1]) < 24 <= 1 + sum(s["accepted"] for s in decode)


def test_decode_bytes_per_step_do_not_grow_with_context(tmp_path):
    """Masks are rebuilt from the block structure: the same block costs the same bytes at 256 and 16k."""
    _, shards = prepare_tiny(tmp_path, "llama", 1, 1)
    per_step = {}
    with ServerThread(load_cloud(shards / "cloud")) as server:
        client = open_client(shards / "local", server.url, allow_public_weights=True, checks=False)
        for context in (256, 4096, 16_384):
            torch.manual_seed(context)
            prompt = torch.randint(0, 96, (context,)).tolist()
            got = client.generate(prompt, max_new_tokens=4, stop_ids=set(), strategy=Tree(TreeConfig(fixed_nodes=8)))
            steps = [s for s in got.steps if s["kind"] == "decode"]
            per_step[context] = [(s["rows"], s["bytes_up"] + s["bytes_down"]) for s in steps]
    # The same block at every context: the root and exactly 8 draft nodes, in every decode step.
    assert all(steps and all(rows == 1 + 8 for rows, _ in steps) for steps in per_step.values()), per_step
    reference = per_step[256][0][1]
    for context in (4096, 16_384):
        for _, size in per_step[context]:
            # Only the digits of the position numbers and the length of the kept path may differ; a mask
            # over the context would add 16k bits here.
            assert abs(size - reference) <= 0.05 * reference, (context, reference, size)
