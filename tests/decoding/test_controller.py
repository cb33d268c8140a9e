"""The cost curve, the break-even size rule and the online BlockController (pure arithmetic, no model)."""

from __future__ import annotations

import pytest

from splitinfer.decoding.controller import (
    BlockController, ControllerConfig, best_size, cost_curve, curve_ms, non_decreasing, row_bucket,
)

SCORES = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.15, 0.1, 0.08, 0.06, 0.05, 0.04, 0.03, 0.02]
ROWS = [1, 3, 5, 9, 17, 33]
# Measured on this project's 2-core VM (SmolLM2-135M's 26 cloud layers, one thread, 200 cached tokens,
# median of 7): the second row costs 17 % of a step, the fifteenth under 1 %.
CPU_CURVE = [(1, 101.0), (2, 118.0), (3, 133.0), (4, 165.0), (6, 182.0), (8, 195.0), (16, 204.0)]


def line(fixed, per_row, rows=None):
    return [fixed + per_row * q for q in range(1, (rows or len(SCORES) + 1) + 1)]


# ---------------------------------------------------------------- cost curve


def test_row_buckets_are_exact_to_four_then_widen():
    assert [row_bucket(q) for q in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 17, 24, 25, 33)] == [
        1, 1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 16, 16, 24, 24, 32, 48]


def test_non_decreasing_pools_violators_by_weight():
    assert non_decreasing([1.0, 3.0, 2.0, 4.0], [1, 1, 1, 1]) == [1.0, 2.5, 2.5, 4.0]
    assert non_decreasing([1.0, 5.0, 2.0], [1, 1, 3]) == [1.0, 2.75, 2.75]
    assert non_decreasing([3.0, 2.0, 1.0], [1, 1, 1]) == [2.0, 2.0, 2.0]


def test_cost_curve_recovers_a_noiseless_concave_curve():
    assert cost_curve(CPU_CURVE * 3) == [(float(q), t) for q, t in CPU_CURVE]


def test_cost_curve_ignores_a_single_slow_step():
    samples = CPU_CURVE * 3 + [(3, 900.0)]  # a garbage collection during one 3-row step
    assert dict(cost_curve(samples))[3.0] == 133.0


def test_cost_curve_pools_a_bucket_measured_slower_than_a_larger_one():
    points = cost_curve([(1, 100.0), (2, 130.0), (4, 120.0)])
    assert points == [(1.0, 100.0), (2.0, 125.0), (4.0, 125.0)]


def test_curve_interpolates_and_extrapolates():
    points = [(2.0, 120.0), (4.0, 140.0), (8.0, 150.0)]
    assert curve_ms(points, 3, prior_slope=5.0) == pytest.approx(130.0)
    assert curve_ms(points, 6, prior_slope=5.0) == pytest.approx(145.0)
    assert curve_ms(points, 1, prior_slope=5.0) == pytest.approx(110.0)  # along the first segment
    assert curve_ms(points, 16, prior_slope=5.0) == pytest.approx(150.0 + 8 * 5.0)  # along the chord 2 -> 8
    assert curve_ms([(1.0, 100.0)], 5, prior_slope=5.0) == pytest.approx(120.0)  # one point: the prior slope
    # A noisy first segment (4 -> 5 rows: +90 ms) would put one row below zero: floored at t0 x rows / r0.
    assert curve_ms([(4.0, 100.0), (5.0, 190.0)], 1, prior_slope=5.0) == pytest.approx(25.0)
    assert curve_ms([(21.0, 100.0)], 1, prior_slope=5.0) == pytest.approx(100.0 / 21)


# ---------------------------------------------------------------- best_size


def test_best_size_zero_when_drafts_are_worthless():
    # Each extra row costs 50 ms but brings at most 1e-3 expected tokens: never worth it.
    assert best_size([1e-3, 1e-4, 1e-5], line(100.0, 50.0, 4)) == 0


def test_best_size_empty_scores_is_zero():
    assert best_size([], [100.0]) == 0


def test_best_size_survives_a_zero_cost():
    assert best_size([0.5], [0.0, 100.0]) == 0  # a free one-row step beats any block


def test_controller_never_prices_a_step_at_zero_whatever_it_measured():
    # What stopped a benchmark run: blocks of 2 and 3 rows only, the 3-row ones slow (noise), so the first
    # segment's slope took a one-row step below zero ms.
    c = BlockController()
    for rows, ms in [(2, 150.0), (3, 400.0)] * 3:
        c.observe(rows, ms, predicted=0.0, accepted_drafts=0)
    assert c.block_ms(1) == pytest.approx(75.0)
    assert c.choose([0.9, 0.5]) in (0, 1, 2)


def test_best_size_all_nodes_when_rows_are_free():
    assert best_size(SCORES, line(100.0, 0.0)) == len(SCORES)
    assert best_size([1e-6] * 5, line(100.0, 0.0, 6)) == 5


def test_best_size_hand_computed_middle_case():
    # scores [0.9, 0.5, 0.1], t(q) = 10 + 2 q; rate(n) = (1 + s_1 + .. + s_n) / t(n + 1)
    #   n=0: 1.0 / 12 = 0.0833
    #   n=1: 1.9 / 14 = 0.1357
    #   n=2: 2.4 / 16 = 0.1500   <- best
    #   n=3: 2.5 / 18 = 0.1389
    assert best_size([0.9, 0.5, 0.1], line(10.0, 2.0, 4)) == 2


def test_best_size_is_the_argmax_of_the_documented_rate():
    costs = [curve_ms([(float(q), t) for q, t in CPU_CURVE], q, 5.0) for q in range(1, len(SCORES) + 2)]
    rates = [(1 + sum(SCORES[:n])) / costs[n] for n in range(len(SCORES) + 1)]
    assert best_size(SCORES, costs) == max(range(len(rates)), key=rates.__getitem__)


# ---------------------------------------------------------------- BlockController


def controller_with_costs(fixed: float, per_row: float, steps: int = 24, rows=ROWS) -> BlockController:
    c = BlockController()
    for i in range(steps):
        q = rows[i % len(rows)]
        c.observe(q, fixed + per_row * q, predicted=0.0, accepted_drafts=0)  # cost only, no calibration
    return c


def controller_on_curve(curve, steps: int = 3) -> BlockController:
    c = BlockController()
    for _ in range(steps):
        for q, ms in curve:
            c.observe(q, ms, predicted=0.0, accepted_drafts=0)
    return c


def test_controller_learns_the_cost_curve_from_observations():
    c = controller_with_costs(100.0, 8.0)
    assert c.curve() == [(float(q), 100.0 + 8.0 * q) for q in ROWS]
    assert c.block_ms(7) == pytest.approx(156.0) and c.block_ms(40) == pytest.approx(420.0)
    assert c.calibration == 1.0  # predicted=0 never touches calibration


def test_controller_cost_priors_before_any_step_and_with_one_row_count():
    c = BlockController(ControllerConfig(prior_step_ms=100.0, prior_per_row=0.05))
    assert [c.block_ms(q) for q in (1, 2, 11)] == pytest.approx([100.0, 105.0, 150.0])
    c.observe(1, 80.0, predicted=0.0, accepted_drafts=0)
    c.observe(1, 120.0, predicted=0.0, accepted_drafts=0)
    assert [c.block_ms(q) for q in (1, 11)] == pytest.approx([100.0, 150.0])  # median one-row time, prior per row


def test_a_cpu_curve_keeps_low_acceptance_text_sequential_where_a_line_would_not():
    # Chat-like drafts: the best node is accepted a quarter of the time. On the measured CPU curve the
    # second row costs 17 %, so speculation does not pay; a line through the same steps (its slope set by
    # the flat large blocks, ~7 ms a row) would have said a 2-row step costs 108 ms and sent two nodes.
    chat = [0.15, 0.08, 0.05, 0.04, 0.03, 0.02, 0.02, 0.01]
    c = controller_on_curve(CPU_CURVE)
    assert c.choose(chat) == 0
    assert best_size(chat, line(101.0 - 7.0, 7.0, len(chat) + 1)) == 2
    # A quoted passage: near-certain nodes fill the flat part of the curve.
    assert c.choose([0.97] * 14 + [0.9] * 2) == 16


def test_cpu_like_costs_pick_fewer_nodes_than_gpu_like_costs():
    cpu = controller_with_costs(100.0, 8.0).choose(SCORES)
    gpu = controller_with_costs(100.0, 0.2).choose(SCORES)
    assert cpu < gpu
    assert cpu == best_size(SCORES, line(100.0, 8.0)) == 7
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
    assert after == best_size([s * c.calibration for s in SCORES], line(fixed, per_row))


def test_calibration_above_one_is_capped_and_scores_capped_at_one():
    c = controller_with_costs(100.0, 8.0)
    for i in range(200):
        q = ROWS[i % len(ROWS)]
        c.observe(q, 100.0 + 8.0 * q, predicted=0.1, accepted_drafts=3)  # far better than predicted
    assert c.calibration == 4.0
    # Scores x4 capped at 1.0: identical to choosing on the capped list.
    capped = [min(s * 4.0, 1.0) for s in SCORES]
    assert c.choose(SCORES) == best_size(capped, line(100.0, 8.0))


def test_step_costs_are_shared_between_controllers_but_calibration_is_not():
    from splitinfer.decoding.controller import StepCosts

    costs = StepCosts()
    first = BlockController(costs=costs)
    for i in range(24):
        q = ROWS[i % len(ROWS)]
        first.observe(q, 100.0 + 8.0 * q, predicted=4.0, accepted_drafts=1)
    second = BlockController(costs=costs)
    assert second.block_ms(9) == pytest.approx(172.0)  # a new generation starts from the measured curve
    assert second.calibration == 1.0 and first.calibration < 0.5
    assert BlockController().block_ms(9) == pytest.approx(140.0)  # an unshared controller starts from the prior


def test_exploration_only_when_cheaper_rows_would_change_the_choice():
    c = controller_with_costs(100.0, 8.0, rows=[1, 3, 5])  # nothing larger than 5 rows measured
    for _ in range(c.config.explore_every):
        c.observe(1, 108.0, predicted=0.0, accepted_drafts=0)
    assert c.costs.since_large >= c.config.explore_every
    assert c.choose([0.01] * 20) == 0  # worthless drafts do not pay even at half the row cost: no exploration
    costs = [c.block_ms(q) for q in range(1, len(SCORES) + 2)]
    halved = [costs[0] + (t - costs[0]) / 2 for t in costs]
    assert best_size(SCORES, costs) < best_size(SCORES, halved)
    assert c.choose(SCORES) == c.config.explore_rows - 1  # they would pay at half the cost: measure a big block


def test_no_exploration_where_the_curve_is_measured():
    c = controller_with_costs(100.0, 8.0)  # blocks up to 33 rows measured
    for _ in range(c.config.explore_every):
        c.observe(1, 108.0, predicted=0.0, accepted_drafts=0)
    assert c.costs.since_large >= c.config.explore_every
    assert c.choose(SCORES) == best_size(SCORES, [c.block_ms(q) for q in range(1, len(SCORES) + 2)]) < 15


def test_any_measured_steps_give_a_positive_non_decreasing_curve():
    import random

    rng = random.Random(0)
    for _ in range(300):
        c = BlockController()
        for _ in range(rng.randint(1, 12)):
            c.observe(rng.randint(1, 40), rng.uniform(0.5, 500.0), predicted=0.0, accepted_drafts=0)
        costs = [c.block_ms(q) for q in range(1, 50)]
        assert all(t > 0 for t in costs)
        assert all(b >= a - 1e-9 for a, b in zip(costs, costs[1:]))
        assert 0 <= c.choose(sorted((rng.random() for _ in range(30)), reverse=True)) <= 30
