"""The cost fit, the break-even size rule and the online BlockController (pure arithmetic, no model)."""

from __future__ import annotations

import pytest

from splitinfer.decoding.controller import BlockController, ControllerConfig, best_size, fit_cost

SCORES = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.15, 0.1, 0.08, 0.06, 0.05, 0.04, 0.03, 0.02]
ROWS = [1, 3, 5, 9, 17, 33]


# ---------------------------------------------------------------- fit_cost


@pytest.mark.parametrize("fixed, per_row", [(100.0, 8.0), (100.0, 0.2), (250.0, 8.0), (0.0, 3.5), (42.0, 0.0)])
def test_fit_cost_recovers_noiseless_line(fixed, per_row):
    samples = [(q, fixed + per_row * q) for q in ROWS]
    got = fit_cost(samples)
    assert got is not None
    assert got[0] == pytest.approx(fixed, abs=1e-9)
    assert got[1] == pytest.approx(per_row, abs=1e-9)


def test_fit_cost_needs_two_distinct_row_counts():
    assert fit_cost([]) is None
    assert fit_cost([(4, 100.0)]) is None
    assert fit_cost([(4, 100.0), (4, 130.0), (4, 90.0)]) is None
    assert fit_cost([(4, 100.0), (5, 130.0)]) is not None


def test_fit_cost_clamps_negative_slope_to_zero():
    # Bigger blocks measured faster (noise, warm-up): slope -10 becomes 0, fixed stays the one-row time.
    samples = [(1, 200.0), (11, 100.0)]
    fixed, per_row = fit_cost(samples)
    assert per_row == 0.0
    assert fixed == pytest.approx(200.0)


def test_fit_cost_ignores_a_single_slow_step():
    # t(q) = 150 + 5q, plus one first-call outlier at q=4; least squares would give a slope near 25.
    samples = [(1, 155.0)] * 20 + [(8, 190.0), (16, 230.0), (4, 250.0), (12, 210.0)]
    fixed, per_row = fit_cost(samples)
    assert per_row == pytest.approx(5.0)
    assert fixed == pytest.approx(150.0)


def test_fit_cost_clamps_negative_intercept_to_zero():
    samples = [(q, -50.0 + 10.0 * q) for q in (10, 20, 30)]
    fixed, per_row = fit_cost(samples)
    assert per_row == pytest.approx(10.0)
    assert fixed == 0.0


# ---------------------------------------------------------------- best_size


def test_best_size_zero_when_drafts_are_worthless():
    # Each extra row costs 50 ms but brings at most 1e-3 expected tokens: never worth it.
    assert best_size([1e-3, 1e-4, 1e-5], fixed=100.0, per_row=50.0) == 0


def test_best_size_empty_scores_is_zero():
    assert best_size([], fixed=100.0, per_row=1.0) == 0


def test_best_size_all_nodes_when_rows_are_free():
    assert best_size(SCORES, fixed=100.0, per_row=0.0) == len(SCORES)
    assert best_size([1e-6] * 5, fixed=100.0, per_row=0.0) == 5


def test_best_size_hand_computed_middle_case():
    # scores [0.9, 0.5, 0.1], fixed 10, per_row 2; rate(n) = (1 + s_1 + .. + s_n) / (10 + 2 (n + 1))
    #   n=0: 1.0 / 12 = 0.0833
    #   n=1: 1.9 / 14 = 0.1357
    #   n=2: 2.4 / 16 = 0.1500   <- best
    #   n=3: 2.5 / 18 = 0.1389
    assert best_size([0.9, 0.5, 0.1], fixed=10.0, per_row=2.0) == 2


def test_best_size_is_the_argmax_of_the_documented_rate():
    fixed, per_row = 100.0, 8.0
    rates = [(1 + sum(SCORES[:n])) / (fixed + per_row * (n + 1)) for n in range(len(SCORES) + 1)]
    assert best_size(SCORES, fixed, per_row) == max(range(len(rates)), key=rates.__getitem__)


# ---------------------------------------------------------------- BlockController


def controller_with_costs(fixed: float, per_row: float, steps: int = 24) -> BlockController:
    c = BlockController()
    for i in range(steps):
        q = ROWS[i % len(ROWS)]
        c.observe(q, fixed + per_row * q, predicted=0.0, accepted_drafts=0)  # cost only, no calibration
    return c


def test_controller_learns_cost_line_from_observations():
    c = controller_with_costs(100.0, 8.0)
    fixed, per_row = c.cost()
    assert fixed == pytest.approx(100.0) and per_row == pytest.approx(8.0)
    assert c.calibration == 1.0  # predicted=0 never touches calibration


def test_controller_cost_priors_before_two_distinct_row_counts():
    c = BlockController(ControllerConfig(prior_per_row=0.05))
    assert c.cost() == (100.0, 5.0)
    c.observe(1, 80.0, predicted=0.0, accepted_drafts=0)
    c.observe(1, 120.0, predicted=0.0, accepted_drafts=0)
    assert c.cost() == pytest.approx((100.0, 5.0))  # mean single-row time, prior fraction per row


def test_cpu_like_costs_pick_fewer_nodes_than_gpu_like_costs():
    cpu = controller_with_costs(100.0, 8.0).choose(SCORES)
    gpu = controller_with_costs(100.0, 0.2).choose(SCORES)
    assert cpu < gpu
    assert cpu == best_size(SCORES, 100.0, 8.0) == 7
    assert gpu == len(SCORES)


def test_large_round_trip_picks_more_nodes_than_small():
    far = controller_with_costs(250.0, 8.0).choose(SCORES)  # ~80 ms RTT on top
    near = controller_with_costs(60.0, 8.0).choose(SCORES)
    assert far > near
    assert (far, near) == (9, 6)


def test_controller_respects_max_nodes():
    c = BlockController(ControllerConfig(max_nodes=4))
    for i in range(12):
        q = ROWS[i % len(ROWS)]
        c.observe(q, 100.0 + 0.01 * q, predicted=0.0, accepted_drafts=0)
    assert c.choose(SCORES) == 4


def test_calibration_moves_toward_half_and_size_shrinks():
    fixed, per_row = 100.0, 8.0
    c = controller_with_costs(fixed, per_row)
    before = c.choose(SCORES)
    history = [c.calibration]
    for i in range(60):
        q = ROWS[i % len(ROWS)]
        c.observe(q, fixed + per_row * q, predicted=4.0, accepted_drafts=2)  # half of what was predicted
        history.append(c.calibration)
    assert history[0] == 1.0
    assert all(b < a for a, b in zip(history, history[1:]))  # monotone toward 0.5
    assert c.calibration == pytest.approx(0.5, abs=0.01)
    assert c.calibration > 0.5
    after = c.choose(SCORES)
    assert after < before
    assert after == best_size([s * c.calibration for s in SCORES], fixed, per_row)


def test_calibration_above_one_is_capped_and_scores_capped_at_one():
    c = controller_with_costs(100.0, 8.0)
    for i in range(200):
        q = ROWS[i % len(ROWS)]
        c.observe(q, 100.0 + 8.0 * q, predicted=0.1, accepted_drafts=3)  # far better than predicted
    assert c.calibration == 4.0
    # Scores x4 capped at 1.0: identical to choosing on the capped list.
    capped = [min(s * 4.0, 1.0) for s in SCORES]
    assert c.choose(SCORES) == best_size(capped, 100.0, 8.0)


def test_step_costs_are_shared_between_controllers_but_calibration_is_not():
    from splitinfer.decoding.controller import StepCosts

    costs = StepCosts()
    first = BlockController(costs=costs)
    for i in range(24):
        q = ROWS[i % len(ROWS)]
        first.observe(q, 100.0 + 8.0 * q, predicted=4.0, accepted_drafts=1)
    second = BlockController(costs=costs)
    assert second.cost() == pytest.approx((100.0, 8.0))  # a new generation starts from the measured line
    assert second.calibration == 1.0 and first.calibration < 0.5
    assert BlockController().cost() == (100.0, 5.0)  # an unshared controller starts from the prior


def test_exploration_only_when_cheaper_rows_would_change_the_choice():
    c = controller_with_costs(100.0, 8.0)
    for _ in range(c.config.explore_every):
        c.observe(1, 108.0, predicted=0.0, accepted_drafts=0)
    assert c.costs.since_large >= c.config.explore_every
    assert c.choose([0.01] * 20) == 0  # worthless drafts do not pay even at half the row cost: no exploration
    fixed, per_row = c.cost()
    assert best_size(SCORES, fixed, per_row, 108.0) < best_size(SCORES, 108.0 - per_row / 2, per_row / 2, 108.0)
    assert c.choose(SCORES) == c.config.explore_rows - 1  # they would pay at half the cost: measure a big block
