"""The throughput model `tok/s = 1000 * a / (RTT + f)`: fit, break-even, projection, efficiency, cost.

`a` is tokens committed per round trip, `RTT` the added round trip in ms, `f` the fixed time of a step
in ms (compute on both sides, serialization, the base network). Pure functions of measured numbers:
no network, no model, nothing measured here.

The fit is a straight line through `1000 / tok/s` (ms per token) against RTT: ms per token =
RTT / a + f / a, so slope = 1 / a and intercept = f / a. With `a` and `f` both free, a mode whose
acceptance changes with RTT (the tree drafts more on a slower link) is fitted by its average behaviour.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class Fit:
    a: float  # tokens per round trip
    f_ms: float  # fixed ms per step
    points: int  # distinct RTTs fitted
    max_residual_ms: float  # largest |measured - fitted| ms per token over the points

    def tokens_per_s(self, rtt_ms: float) -> float:
        return 1000.0 * self.a / (rtt_ms + self.f_ms)

    def as_dict(self) -> dict:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self).items()}


def fit(rtts_ms: list[float], tokens_per_s: list[float]) -> Fit:
    """Least squares on ms per token against RTT; needs two distinct RTTs and an increasing line."""
    if len(rtts_ms) != len(tokens_per_s) or len(set(rtts_ms)) < 2:
        raise ConfigError("fitting tok/s = 1000*a/(RTT+f) needs measurements at two or more different round trips.")
    if any(t <= 0 for t in tokens_per_s):
        raise ConfigError("every tok/s to fit must be positive.")
    ms_per_token = [1000.0 / t for t in tokens_per_s]
    slope, intercept = statistics.linear_regression(rtts_ms, ms_per_token)
    if slope <= 0:
        raise ConfigError("ms per token did not grow with the round trip in these measurements; the model does not fit.")
    a = 1.0 / slope
    residual = max(abs(m - (slope * r + intercept)) for r, m in zip(rtts_ms, ms_per_token))
    return Fit(a=a, f_ms=intercept * a, points=len(set(rtts_ms)), max_residual_ms=residual)


def break_even_acceptance(rtt_ms: float, f_spec_ms: float, f_seq_ms: float) -> float:
    """a* = (RTT + f_spec) / (RTT + f_seq): the tokens per step a speculative mode needs to match sequential.

    It falls towards 1 as RTT grows (a bigger block costs little next to the round trip) and rises as RTT
    falls, so speculation pays less, not more, on a fast link.
    """
    if rtt_ms + f_seq_ms <= 0:
        raise ConfigError("RTT + f of sequential decoding must be positive.")
    return (rtt_ms + f_spec_ms) / (rtt_ms + f_seq_ms)


def efficiency(tokens_per_s: float, a: float, rtt_ms: float, local_ms: float, cloud_ms: float) -> float:
    """Measured tok/s over the bound 1000 * a / (RTT + local compute + cloud compute): what the rest costs."""
    bound = 1000.0 * a / (rtt_ms + local_ms + cloud_ms)
    return tokens_per_s / bound


def cost_per_million_tokens(price_per_hour: float, tokens_per_s: float) -> float:
    """$ per million output tokens when one GPU at `price_per_hour` serves a single stream at `tokens_per_s`."""
    if price_per_hour < 0 or tokens_per_s <= 0:
        raise ConfigError("the GPU price must be >= 0 and the token rate > 0.")
    return price_per_hour / (tokens_per_s * 3600.0) * 1e6


def relative_error(measured: float, expected: float) -> float:
    return abs(measured - expected) / abs(expected)


def check(name: str, measured: float, expected: float, tolerance: float) -> dict:
    """A pass/fail line the tools print and store: |measured - expected| / expected <= tolerance."""
    error = relative_error(measured, expected)
    return {
        "check": name,
        "measured": round(measured, 3),
        "expected": round(expected, 3),
        "relative_error": round(error, 4),
        "tolerance": tolerance,
        "passed": error <= tolerance,
    }


def project(fits: dict[str, Fit], rtts_ms: list[float]) -> list[dict]:
    """Projected tok/s of every fitted mode at each RTT (rows: RTT; columns: modes)."""
    return [{"rtt_ms": r, **{mode: round(f.tokens_per_s(r), 3) for mode, f in fits.items()}} for r in rtts_ms]
