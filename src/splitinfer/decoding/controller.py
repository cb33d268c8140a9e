"""How many draft nodes to verify per round trip, decided from measurement.

A step that verifies q block rows costs t(q) = fixed + per_row * q milliseconds (round trip, local and
cloud compute, bytes), fitted online from the steps actually taken. A draft of n nodes with calibrated
acceptance probabilities s_1 >= s_2 >= ... commits 1 + s_1 + ... + s_n tokens in expectation. The
controller picks the n that maximises expected tokens per millisecond; n = 0 is plain sequential
decoding, chosen whenever speculation would not pay (the break-even rule). On a CPU a block costs much
more than one row, on a GPU tens of rows cost about one: the fit learns which machine it is on.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class ControllerConfig:
    max_nodes: int = 32  # draft nodes per step at most
    window: int = 48  # recent steps used for the cost fit
    prior_per_row: float = 0.05  # per-row cost as a fraction of a one-row step, until measured
    calibration_decay: float = 0.9  # weight of history in the acceptance calibration


def fit_cost(samples) -> tuple[float, float] | None:
    """Least-squares (fixed, per_row) from (rows, ms) samples; None without two distinct row counts."""
    rows = [q for q, _ in samples]
    if len(set(rows)) < 2:
        return None
    n = len(samples)
    mean_q = sum(rows) / n
    mean_t = sum(t for _, t in samples) / n
    sxx = sum((q - mean_q) ** 2 for q in rows)
    sxy = sum((q - mean_q) * (t - mean_t) for q, t in samples)
    per_row = max(sxy / sxx, 0.0)
    return max(mean_t - per_row * mean_q, 0.0), per_row


def best_size(scores: list[float], fixed: float, per_row: float) -> int:
    """The n maximising (1 + sum(scores[:n])) / (fixed + per_row * (n + 1)); scores sorted descending."""
    best_n, best_rate, expected = 0, 1.0 / (fixed + per_row), 1.0
    for n, s in enumerate(scores, start=1):
        expected += s
        rate = expected / (fixed + per_row * (n + 1))
        if rate > best_rate:
            best_n, best_rate = n, rate
    return best_n


class BlockController:
    def __init__(self, config: ControllerConfig = ControllerConfig()):
        self.config = config
        self._samples: deque[tuple[int, float]] = deque(maxlen=config.window)
        self._predicted = 1.0  # discounted sums for calibration of draft scores
        self._accepted = 1.0

    @property
    def calibration(self) -> float:
        return min(self._accepted / self._predicted, 4.0)

    def cost(self) -> tuple[float, float]:
        fitted = fit_cost(self._samples)
        if fitted is not None:
            return fitted
        if self._samples:
            single = sum(t for _, t in self._samples) / len(self._samples)
            return single, single * self.config.prior_per_row
        return 100.0, 5.0

    def choose(self, scores: list[float]) -> int:
        """How many of the (descending) draft scores to send this step."""
        calibrated = [min(s * self.calibration, 1.0) for s in scores[: self.config.max_nodes]]
        # Keep the list non-increasing after capping so the prefix rule stays valid.
        fixed, per_row = self.cost()
        return best_size(calibrated, fixed, per_row)

    def observe(self, rows: int, step_ms: float, predicted: float, accepted_drafts: int) -> None:
        self._samples.append((rows, step_ms))
        if predicted > 0:
            d = self.config.calibration_decay
            self._predicted = d * self._predicted + predicted
            self._accepted = d * self._accepted + accepted_drafts
