"""The throughput model as pure functions: fit, break-even, efficiency, cost, checks (no network)."""

from __future__ import annotations

import pytest

from splitinfer.bench import throughput
from splitinfer.errors import ConfigError


def _rates(a: float, f: float, rtts: list[float]) -> list[float]:
    return [1000 * a / (r + f) for r in rtts]


@pytest.mark.parametrize("a, f", [(1.0, 87.0), (2.4, 130.0), (0.9, 5.0)])
def test_fit_recovers_a_and_f_from_exact_points(a, f):
    rtts = [0, 20, 40, 80, 150]
    fit = throughput.fit(rtts, _rates(a, f, rtts))
    assert fit.a == pytest.approx(a, rel=1e-9) and fit.f_ms == pytest.approx(f, rel=1e-9)
    assert fit.points == 5 and fit.max_residual_ms < 1e-9
    assert fit.tokens_per_s(60) == pytest.approx(1000 * a / (60 + f))


def test_fit_with_noise_stays_close_and_reports_the_residual():
    rtts = [0, 20, 40, 80, 150]
    noisy = [t * m for t, m in zip(_rates(1.0, 90.0, rtts), [1.02, 0.98, 1.01, 0.99, 1.0])]
    fit = throughput.fit(rtts, noisy)
    assert fit.a == pytest.approx(1.0, rel=0.05) and fit.f_ms == pytest.approx(90.0, rel=0.1)
    assert 0.5 < fit.max_residual_ms < 5


@pytest.mark.parametrize(
    "rtts, tps, match",
    [
        ([80], [5.0], "two or more different round trips"),
        ([80, 80], [5.0, 5.1], "two or more different round trips"),
        ([0, 80], [5.0], "two or more"),
        ([0, 80], [5.0, 0.0], "positive"),
        ([0, 80], [5.0, 6.0], "did not grow with the round trip"),
    ],
)
def test_fit_refuses_what_it_cannot_fit(rtts, tps, match):
    with pytest.raises(ConfigError, match=match):
        throughput.fit(rtts, tps)


def test_break_even_falls_towards_one_as_rtt_grows():
    # speculation whose step costs 150 ms against sequential's 90 ms
    values = [throughput.break_even_acceptance(r, 150.0, 90.0) for r in (0, 20, 80, 150, 1000)]
    assert values[0] == pytest.approx(150 / 90)
    assert values[2] == pytest.approx(230 / 170)
    assert all(x > y for x, y in zip(values, values[1:])) and values[-1] > 1.0
    with pytest.raises(ConfigError):
        throughput.break_even_acceptance(0, 10.0, 0.0)


def test_efficiency_and_cost():
    # 1000 * 2 / (80 + 20 + 60) = 12.5 tok/s is the bound; 10 measured
    assert throughput.efficiency(10.0, 2.0, 80.0, 20.0, 60.0) == pytest.approx(0.8)
    # $3.60/h at 1 tok/s: 3600 tokens per $3.60 -> $1000 per million
    assert throughput.cost_per_million_tokens(3.6, 1.0) == pytest.approx(1000.0)
    assert throughput.cost_per_million_tokens(2.0, 10.0) == pytest.approx(2.0 / 36000 * 1e6)
    with pytest.raises(ConfigError):
        throughput.cost_per_million_tokens(2.0, 0.0)


def test_check_passes_inside_and_fails_outside_the_tolerance():
    assert throughput.check("x", 88.0, 80.0, 0.10)["passed"] is True
    failed = throughput.check("x", 89.0, 80.0, 0.10)
    assert failed["passed"] is False and failed["relative_error"] == pytest.approx(0.1125)


def test_projection_table():
    fits = {"seq": throughput.Fit(1.0, 100.0, 5, 0.0), "tree": throughput.Fit(2.0, 150.0, 5, 0.0)}
    table = throughput.project(fits, [0, 250])
    assert table == [{"rtt_ms": 0, "seq": 10.0, "tree": 13.333}, {"rtt_ms": 250, "seq": 2.857, "tree": 5.0}]
