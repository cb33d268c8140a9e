"""The T6 attackers (privacy/traffic.py) on synthetic traffic: they read what sizes and times carry, and no
more than chance when the sizes are padded and the times carry nothing."""

from __future__ import annotations

import numpy as np

from splitinfer.privacy.traffic import (
    SIZES,
    TIMING,
    attack_category,
    attack_document,
    attack_steps,
    attack_steps_lookup,
    exchanges,
    generation_features,
    knn,
    majority,
    step_features,
)

from synthetic_traffic import ROW, synthetic, traces


def test_exchanges_pair_requests_with_replies_and_leave_the_close_out():
    trace = traces(1, False, 0)[0]
    ex = exchanges(trace)
    assert len(ex) == 2 + len(trace.accepted)
    assert all(down_t > up_t for _, _, up_t, down_t in ex)
    assert step_features(trace, ROW).shape == (len(trace.accepted), 7)
    assert generation_features(trace)[0] == len(trace.accepted)


def test_unpadded_sizes_give_the_accepted_counts_away():
    scored = attack_steps(traces(30, False, 1), traces(30, False, 2, "q"), SIZES, ROW, 5)
    assert scored.hits.mean() > 0.95 > scored.chance_hits.mean()


def test_the_size_lookup_reads_unpadded_steps_and_only_guesses_the_majority_on_padded_ones():
    found = attack_steps_lookup(traces(30, False, 1), traces(30, False, 2, "q"), ROW)
    assert found.hits.mean() > 0.95
    padded = attack_steps_lookup(traces(30, True, 1), traces(30, True, 2, "q"), ROW)
    last = np.cumsum([len(t.accepted) for t in traces(30, True, 2, "q")]) - 1  # before the close: its own key
    middle = np.setdiff1d(np.arange(len(padded.hits)), last)
    assert np.array_equal(padded.hits[middle], padded.chance_hits[middle])


def test_padded_sizes_and_meaningless_times_leave_the_attacker_at_chance():
    for features in (SIZES, TIMING):
        scored = attack_steps(traces(60, True, 3), traces(60, True, 4, "q"), features, ROW, 5)
        assert scored.hits.mean() <= scored.chance_hits.mean() + 0.05, features


def test_the_category_shows_in_unpadded_traffic_and_not_in_traffic_that_carries_none():
    found = attack_category(traces(30, False, 5), traces(30, False, 6, "q"), SIZES, 3)
    assert found.hits.mean() >= 0.9
    blind = attack_category(traces(90, True, 7), traces(90, True, 8, "q"), TIMING, 3)
    assert blind.hits.mean() < 0.5  # three balanced classes, nothing in the traffic: about a third


def test_a_known_document_is_found_again_by_its_trace():
    known = traces(12, False, 9)
    again = [synthetic(t.prompt_id, t.category, list(t.accepted), False, np.random.default_rng(i))
             for i, t in enumerate(known)]
    scored = attack_document(known, again, SIZES)
    assert scored.hits.all() and scored.chance == 1 / 12


def test_knn_votes_and_the_majority_breaks_ties_to_the_smallest():
    x = np.array([[0.0], [0.1], [5.0], [5.1], [5.2]])
    assert knn(x, ["a", "a", "b", "b", "b"], np.array([[0.05], [5.05]]), 3) == ["a", "b"]
    flat = np.zeros((5, 1))  # nothing tells the rows apart: every row votes, the majority wins
    assert knn(flat, ["a", "a", "b", "b", "b"], np.zeros((1, 1)), 1) == ["b"]
    assert majority([2, 1, 2, 1, 3]) == 1
