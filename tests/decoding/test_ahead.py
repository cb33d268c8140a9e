"""The rule that sends a block ahead, in the regimes it must tell apart, and the estimates it reads."""

from __future__ import annotations

import pytest

from splitinfer.decoding.ahead import AheadConfig, AheadController, Costs, drop_cost_ms, saving_ms, worth_sending

# A CPU cloud at 80 ms (docs/design.md): the cloud's pass is the largest stage; the client makes a block in 25 ms.
SLOW_CLOUD = Costs(latency_ms=80 + 120, cloud_ms=120, client_ms=50, make_ms=25)
# The same CPU cloud with no added round trip: the cloud's pass is most of the latency.
SLOW_CLOUD_LAN = Costs(latency_ms=125, cloud_ms=120, client_ms=50, make_ms=25)
# A GPU cloud (a pass of a few ms) behind a 200 ms round trip; the client is the slow side.
FAST_CLOUD = Costs(latency_ms=200 + 5, cloud_ms=5, client_ms=60, make_ms=30)


def threshold(depth: int, costs: Costs) -> float:
    """The p above which the rule sends ahead (bisection on the rule itself)."""
    low, high = 0.0, 1.0
    for _ in range(50):
        mid = (low + high) / 2
        low, high = (low, mid) if worth_sending(mid, depth, costs) else (mid, high)
    return high


def test_a_slow_cpu_cloud_with_no_round_trip_to_hide_rarely_sends_ahead():
    assert threshold(2, SLOW_CLOUD_LAN) > 0.5  # a block ahead must hold more often than not
    assert not worth_sending(0.3, 2, SLOW_CLOUD_LAN)
    assert not worth_sending(0.1, 2, SLOW_CLOUD_LAN)  # what the tree's guesses hold
    assert not worth_sending(0.95, 3, SLOW_CLOUD_LAN)  # two blocks ahead cannot beat the busy cloud


def test_a_long_round_trip_hides_a_dropped_pass_so_the_likelier_blocks_go_ahead():
    assert 0.1 < threshold(2, SLOW_CLOUD) < 0.3
    assert worth_sending(0.3, 2, SLOW_CLOUD) and not worth_sending(0.1, 2, SLOW_CLOUD)
    assert not worth_sending(0.9, 3, SLOW_CLOUD)  # a third block's pass would run into the next valid block


def test_a_fast_cloud_behind_a_long_round_trip_sends_ahead_when_p_is_moderate():
    assert 0.1 < threshold(2, FAST_CLOUD) < 0.3
    assert worth_sending(0.3, 2, FAST_CLOUD)
    assert not worth_sending(0.1, 2, FAST_CLOUD)
    assert worth_sending(0.5, 3, FAST_CLOUD)  # a third block still hides round trip behind the client


def test_the_saving_follows_the_pipelining_model():
    period = FAST_CLOUD.latency_ms + FAST_CLOUD.client_ms  # 265 ms one block at a time
    assert saving_ms(2, FAST_CLOUD) == pytest.approx(period - period / 2)
    assert saving_ms(3, FAST_CLOUD) == pytest.approx(period / 2 - period / 3)
    # the busiest stage bounds the gain: past it, more blocks in flight save nothing
    assert saving_ms(3, SLOW_CLOUD_LAN) == 0.0


def test_a_dropped_block_costs_the_part_of_its_pass_still_running_when_the_next_valid_one_arrives():
    # the next valid block arrives 125 + 50 ms after the oldest block's pass began: the block at depth 2 runs
    # from 120 to 240 ms (65 ms left), the one at depth 3 has not started (skipped)
    assert drop_cost_ms(2, SLOW_CLOUD_LAN) == pytest.approx(65 + 25)
    assert drop_cost_ms(3, SLOW_CLOUD_LAN) == pytest.approx(25)
    # at 80 ms the depth-2 pass is over by then (120..240 < 250), the depth-3 one has 110 ms left
    assert drop_cost_ms(2, SLOW_CLOUD) == pytest.approx(25)
    assert drop_cost_ms(3, SLOW_CLOUD) == pytest.approx(110 + 25)
    assert drop_cost_ms(2, FAST_CLOUD) == pytest.approx(30)  # a GPU's pass is always over: the client's time
    assert worth_sending(1.0, 2, FAST_CLOUD) and not worth_sending(0.0, 2, FAST_CLOUD)


def test_nothing_goes_ahead_until_latency_was_measured():
    controller = AheadController(AheadConfig(min_samples=2))
    controller.observe_block(cloud_ms=5, client_ms=60, make_ms=30, latency_ms=None)  # a block that waited behind one
    controller.observe_block(cloud_ms=5, client_ms=60, make_ms=30, latency_ms=205)
    assert controller.costs() is None and not controller.worth(0.9, 2)
    controller.observe_block(cloud_ms=5, client_ms=60, make_ms=30, latency_ms=205)
    assert controller.costs() == FAST_CLOUD
    assert controller.worth(0.9, 2)


def test_the_estimates_follow_a_change():
    controller = AheadController(AheadConfig(decay=0.5, min_samples=1))
    controller.observe_block(cloud_ms=100, client_ms=50, make_ms=25, latency_ms=200)
    for _ in range(20):
        controller.observe_block(cloud_ms=5, client_ms=50, make_ms=25, latency_ms=100)
    costs = controller.costs()
    assert costs.cloud_ms == pytest.approx(5, abs=1e-3) and costs.latency_ms == pytest.approx(100, abs=1e-3)


def test_the_hold_rate_calibrates_the_scores():
    config = AheadConfig(hold_floor=0.05, hold_cap=3.0)
    wrong, right = AheadController(config), AheadController(config)
    for _ in range(60):
        wrong.observe_assumption(0.5, held=False)  # scored 0.5, never held
        right.observe_assumption(0.2, held=True)  # scored 0.2, always held
    assert wrong.p(0.5) == pytest.approx(0.5 * 0.05)  # down to the floor, so it keeps learning
    assert right.p(0.2) == pytest.approx(0.6)  # up to the cap
    assert (wrong.assumptions, wrong.held, right.held) == (60, 0, 60)
    calibrated = AheadController(config)
    for i in range(200):
        calibrated.observe_assumption(0.4, held=i % 5 < 2)  # held 2 times in 5: the score was right
    assert calibrated.p(0.4) == pytest.approx(0.4, abs=0.05)


def test_config_is_checked():
    with pytest.raises(ValueError):
        AheadConfig(decay=1.0)
