"""Speculative sampling draws from the same distribution as sequential sampling (and the test can tell)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency
from transformers import AutoModelForCausalLM, LlamaConfig

from splitinfer.decoding import loop
from splitinfer.decoding.draft import Draft, children_of
from splitinfer.decoding.sampling import SamplingConfig, make_chooser, target_probs
from splitinfer.decoding.strategies import Sequential, Strategy, Tree, TreeConfig
from splitinfer.clients import open_client
from splitinfer.model.prepare import prepare
from splitinfer.model.source import SourceModel

from tiny import random_head

VOCAB = 12
PROMPT = [1, 5, 7, 2]
RUNS = 1200


class FullTree(Strategy):
    """Every root gets children 0..3, each with children 0..3: drafts exist whatever is sampled."""

    name = "full-tree"

    def propose(self, history):
        tokens, parents = [0, 1, 2, 3], [0, 0, 0, 0]
        for child_row in range(1, 5):
            tokens += [0, 1, 2, 3]
            parents += [child_row] * 4
        return Draft(tokens=tokens, parents=parents, scores=[0.5] * len(tokens))


@pytest.fixture(scope="module")
def spread_model(tmp_path_factory):
    """A tiny model with a spread-out next-token distribution (default init, 12 tokens)."""
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # logits of order 1: neither uniform nor one-hot
    out = tmp_path_factory.mktemp("spread")
    prepare(SourceModel("spread", model.config, model, None), out, 1, 1, "float32")
    return open_client(local_only=True, shards=out)


def second_and_third(client, strategy_factory, seeds):
    samples = Counter()
    for seed in seeds:
        got = client.generate(PROMPT, max_new_tokens=3, stop_ids=set(), strategy=strategy_factory(),
                              sampling=SamplingConfig(temperature=1.0, seed=seed))
        samples[tuple(got.token_ids[1:])] += 1
    return samples


def homogeneity_p(a: Counter, b: Counter, min_count: int = 5) -> float:
    """Chi-square test that two samples of token pairs come from one distribution (rare cells pooled)."""
    cells = sorted(set(a) | set(b))
    common = [c for c in cells if a[c] + b[c] >= min_count]
    rare = [c for c in cells if c not in common]
    table = [[a[c] for c in common] + [sum(a[c] for c in rare)], [b[c] for c in common] + [sum(b[c] for c in rare)]]
    table = np.array([row for row in zip(*table) if sum(row) > 0]).T
    return chi2_contingency(table)[1]


def wrong_accept(tokens, parents, logits, choose):
    """A plausible but wrong rule: take a child if it is the row's most likely token, else sample."""
    children = children_of(tokens, parents)
    path, row = [0], 0
    while True:
        best = int(torch.argmax(logits[row]))
        if best in children.get(row, {}):
            path.append(children[row][best])
            row = children[row][best]
            continue
        token = choose(logits[row])
        child = children.get(row, {}).get(token)
        if child is None:
            return path, token
        path.append(child)
        row = child


def head_tree(client):
    """The tree strategy with a (random) learned draft head as one more source, always sending its nodes."""
    head = random_head(client.local, seed=5)
    return lambda: Tree(TreeConfig(fixed_nodes=12), head=head)


@pytest.mark.slow  # 7,200 sampled generations: ~1 minute a drafter on a quiet core
@pytest.mark.parametrize("drafter", ["full-tree", "head"])
def test_speculative_sampling_matches_sequential_and_the_test_catches_a_wrong_rule(spread_model, monkeypatch, drafter):
    draft = FullTree if drafter == "full-tree" else head_tree(spread_model)
    sequential = second_and_third(spread_model, Sequential, range(RUNS))
    speculative = second_and_third(spread_model, draft, range(RUNS, 2 * RUNS))
    p_same = homogeneity_p(sequential, speculative)
    print(f"\nhomogeneity p-values: speculative {p_same:.3g}", end="")
    assert p_same > 0.01, p_same
    monkeypatch.setattr(loop, "accept", wrong_accept)
    biased = second_and_third(spread_model, draft, range(2 * RUNS, 3 * RUNS))
    p_wrong = homogeneity_p(sequential, biased)
    print(f", wrong rule {p_wrong:.3g}")
    assert p_wrong < 1e-4, p_wrong  # the negative control: the same test rejects a wrong acceptance rule


def test_same_seed_gives_the_same_tokens_with_and_without_speculation(spread_model):
    for seed in range(5):
        config = SamplingConfig(temperature=0.8, top_p=0.95, seed=seed)
        seq = spread_model.generate(PROMPT, max_new_tokens=12, stop_ids=set(), strategy="sequential", sampling=config)
        spec = spread_model.generate(PROMPT, max_new_tokens=12, stop_ids=set(), strategy=FullTree(), sampling=config)
        assert spec.token_ids == seq.token_ids
        assert spec.stats["mean_accepted_per_step"] > 1.0


def test_top_k_and_top_p_truncate_the_distribution():
    row = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    assert (target_probs(row, SamplingConfig(top_k=2)) > 0).tolist() == [True, True, False, False, False]
    probs = torch.softmax(row, 0)
    kept = target_probs(row, SamplingConfig(top_p=float(probs[0] + probs[1]) - 1e-3))
    assert (kept > 0).tolist() == [True, True, False, False, False]
    assert abs(float(kept.sum()) - 1.0) < 1e-6
    choose = make_chooser(SamplingConfig(top_k=1, seed=0))
    assert {choose(row) for _ in range(20)} == {0}
