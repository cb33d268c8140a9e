"""The one acceptance estimator and its two layers (calibration.py), on hand-made drafts."""

from __future__ import annotations

import pytest
import torch

from splitinfer.decoding.calibration import CalibrationConfig, NodeCalibration, Ratio, prior_continue_prob
from splitinfer.decoding.draft import TokenTrie
from splitinfer.decoding.sources import TokenRecycling


def test_ratio_starts_at_its_prior_forgets_and_stays_in_bounds():
    r = Ratio(prior=2.0, decay=0.5, prior_ratio=0.75)
    assert r.value == pytest.approx(0.75)
    r.update(predicted=1.0, accepted=0.0)
    assert (r.predicted, r.accepted) == pytest.approx((2.0, 0.75))  # 0.5 * 2 + 1, 0.5 * 1.5 + 0
    bounded = Ratio(prior=1.0, decay=1.0, floor=0.2, cap=1.5)
    bounded.update(100.0, 0.0)
    assert bounded.value == 0.2
    bounded.update(0.0, 1000.0)
    assert bounded.value == 1.5


def test_copy_estimates_start_at_the_prior_and_learn_per_match_length():
    cal = NodeCalibration(CalibrationConfig(copy_cap=8, copy_prior=4.0, copy_decay=1.0))
    assert cal.continue_prob(2) == pytest.approx(2 / 4)
    assert cal.continue_prob(50) == pytest.approx(8 / 10)  # lengths past the cap share its estimate
    assert cal.continue_prob(0) == pytest.approx(1 / 3)  # no match yet counts as the first token
    keys = [("suffix", 8), ("suffix", 1)] * 36
    cal.observe(keys, [0] * len(keys), {0} | {i + 1 for i in range(0, len(keys), 2)})  # every L=8 node accepted
    # 4 prior observations at 0.8 + 36 hits; 4 prior at 1/3 + 36 misses.
    assert cal.continue_prob(8) == pytest.approx((3.2 + 36) / 40)
    assert cal.continue_prob(1) == pytest.approx((4 / 3) / 40)
    assert cal.continue_prob(4) == pytest.approx(4 / 6)  # untouched lengths keep their prior


def test_only_nodes_whose_parent_was_accepted_are_evidence():
    cal = NodeCalibration(CalibrationConfig(copy_decay=1.0))
    # Row 1 (L=3) rejected, so its child row 2 (L=4) was never tested; row 3 (L=5, below the root) accepted.
    cal.observe([("suffix", 3), ("suffix", 4), ("suffix", 5)], [0, 1, 0], {0, 3})
    assert cal.continue_prob(3) < prior_continue_prob(3)
    assert cal.continue_prob(4) == pytest.approx(prior_continue_prob(4))
    assert cal.continue_prob(5) > prior_continue_prob(5)
    assert cal.continue_prob(3) == pytest.approx(4 * 0.6 / 5)


def recycling_draft(weight: float):
    """Token Recycling's draft for root 0 (successors 1: 0.6, then 1 -> 2: 0.5), weighted by `weight`."""
    vocab = 8
    rows = torch.full((2, vocab), -1e9)
    rows[0, 1], rows[0, 3] = torch.log(torch.tensor(0.6)), torch.log(torch.tensor(0.4))
    rows[1, 2], rows[1, 4] = torch.log(torch.tensor(0.5)), torch.log(torch.tensor(0.5))
    rec = TokenRecycling(k=2)
    rec.observe([0, 1], rows)
    trie = TokenTrie()
    rec.propose(0, trie, max_nodes=2, max_depth=2, weight=weight)
    return trie.best(2)


def test_recycling_learns_against_its_own_probabilities_not_its_weighted_scores():
    draft = recycling_draft(weight=0.5)
    assert draft.tokens == [1, 3] and draft.keys == [("recycling", pytest.approx(0.6)), ("recycling", pytest.approx(0.4))]
    assert draft.scores == pytest.approx([0.3, 0.2])  # the weight is in the scores once per step
    cal = NodeCalibration(CalibrationConfig(recycling_prior=1.0, recycling_decay=1.0))
    cal.observe(draft.keys, draft.parents, {0, 1})  # token 1 accepted, 3 not
    # Evidence is the unweighted 0.6 + 0.4 predicted against 1 accepted: the weight 0.5 did not enter it.
    assert cal.recycling_weight == pytest.approx((1.0 + 1.0) / (1.0 + 1.0))
    cal.observe(draft.keys, draft.parents, {0})
    assert cal.recycling_weight == pytest.approx(2.0 / 3.0)


def test_recycling_child_of_another_sources_node_learns_its_own_probability():
    # A recycling node below a suffix node: its evidence is its own p, whatever its parent's score.
    trie = TokenTrie()
    trie.add_path([5], [0.9], "suffix", [("suffix", 4)])
    trie.add_path([5, 6], [0.05, 0.7], "recycling", [("recycling", 0.05), ("recycling", 0.7)])
    draft = trie.best(2)
    assert draft.keys == [("suffix", 4), ("recycling", 0.7)]
    cal = NodeCalibration(CalibrationConfig(recycling_prior=1.0, recycling_decay=1.0, copy_decay=1.0))
    cal.observe(draft.keys, draft.parents, {0, 1, 2})
    assert cal.recycling_weight == pytest.approx((1.0 + 1.0) / (1.0 + 0.7))
    assert cal.continue_prob(4) > prior_continue_prob(4)


def test_tree_feeds_both_layers_from_one_verified_block():
    from splitinfer.decoding.strategies import Tree, TreeConfig

    tree = Tree(TreeConfig(fixed_nodes=3, prompt_rows=1))
    tree.start([1, 2, 3, 1, 2], torch.zeros(1, 16))
    draft = tree.propose([1, 2, 3, 1, 2])
    assert draft.tokens[0] == 3 and draft.keys[0][0] == "suffix"
    residual_before = tree.controller.residual.predicted
    prob_before = tree.calibration.continue_prob(draft.keys[0][1])
    logits = torch.zeros(len(draft) + 1, 16)
    tree.observe([2, *draft.tokens], [-1, *draft.parents], logits, [0, 1], [3, 0], 100.0)
    assert tree.calibration.continue_prob(draft.keys[0][1]) > prob_before  # the copy went on
    # The residual learned against the sum of the calibrated path scores that were sent.
    decay = tree.controller.config.calibration_decay
    assert tree.controller.residual.predicted == pytest.approx(decay * residual_before + sum(draft.scores))
