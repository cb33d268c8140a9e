"""Statistics of the audit: intervals over documents, exact McNemar, baselines, packed outcomes."""

from __future__ import annotations

import numpy as np
import pytest

from splitinfer.privacy import stats


def test_bootstrap_interval_brackets_rate_and_widens_with_fewer_documents():
    rng = np.random.default_rng(0)
    correct = rng.random(2000) < 0.3
    many = stats.bootstrap_ci(correct, np.arange(2000) // 10)
    few = stats.bootstrap_ci(correct, np.arange(2000) // 500)
    assert many[0] < correct.mean() < many[1]
    assert (few[1] - few[0]) > (many[1] - many[0])


def test_mcnemar_counts_discordant_pairs_and_matches_binomial():
    a = np.array([1, 1, 1, 0, 0, 1, 0, 1], bool)
    b = np.array([1, 0, 0, 1, 0, 0, 0, 0], bool)
    result = stats.mcnemar(a, b)
    assert (result["n01"], result["n10"]) == (1, 4)
    assert result["p_value"] == pytest.approx(0.375)  # 2 * P(X <= 1), X ~ Bin(5, 1/2)
    assert stats.mcnemar(a, a)["p_value"] == 1.0


def test_baselines_prior_and_ceiling():
    train = np.array([5, 5, 5, 7, 7, 9])
    test = np.array([5, 7, 9, 11])
    base = stats.baselines(train, test, np.array([0, 0, 1, 1]))
    assert base["majority_token"] == 5
    assert base["baseline_top1"] == 0.25
    assert base["baseline_top5"] == 0.75
    assert base["ceiling"] == 0.75  # token 11 never occurs in training


def test_buckets_exact_sequences_and_packing():
    correct = np.array([1, 1, 0, 1, 1], bool)
    buckets = stats.by_bucket(correct, np.array([1, 1, 2, 3, 3]), np.array([1] * 60 + [2]))
    assert buckets["frequent 50+"] == {"n": 2, "top1": 1.0}
    assert buckets["unseen"]["n"] == 2
    assert stats.exact_sequences(correct, np.array([0, 0, 1, 1, 2])) == pytest.approx(2 / 3)
    assert (stats.unpack(stats.pack(correct), 5) == correct).all()
