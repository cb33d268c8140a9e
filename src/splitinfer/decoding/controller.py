"""How many draft nodes to verify per round trip, decided from measurement.

A step that verifies q block rows costs t(q) = fixed + per_row * q milliseconds (round trip, local and
cloud compute, bytes), fitted online from the steps actually taken. A draft of n nodes with calibrated
acceptance probabilities s_1 >= s_2 >= ... commits 1 + s_1 + ... + s_n tokens in expectation. The
controller picks the n that maximises expected tokens per millisecond; n = 0 is plain sequential
decoding, chosen whenever speculation would not pay (the break-even rule). On a CPU a block costs much
more than one row, on a GPU tens of rows cost about one: the fit learns which machine it is on.

What a row costs depends on the machines and the link, not on the text, so the measured steps live in a
`StepCosts` that a client shares between its generations (SplitClient keeps one per connection): a new
generation starts from what the earlier ones measured instead of from a prior. What drafts are worth
depends on the text and stays with each generation: the scores arrive calibrated per node, and the
controller multiplies them by its own residual ratio (the second layer in calibration.py).
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from dataclasses import dataclass

from .calibration import Ratio


@dataclass(frozen=True)
class ControllerConfig:
    max_nodes: int = 32  # draft nodes per step at most
    window: int = 48  # recent steps used for the cost fit
    prior_per_row: float = 0.05  # per-row cost as a fraction of a one-row step, until measured
    calibration_decay: float = 0.97  # weight of history in the residual acceptance ratio
    calibration_prior: float = 8.0  # predicted drafts, at ratio 1, the residual starts from
    calibration_floor: float = 0.25  # never trust drafts less than this, so the controller keeps exploring
    calibration_cap: float = 4.0  # nor more than this
    explore_rows: int = 16  # block size of an exploration step, which measures what rows really cost
    explore_every: int = 24  # at most this many steps without a block that large


def weighted_median(values: list[float], weights: list[float]) -> float:
    pairs = sorted(zip(values, weights))
    half, running = sum(weights) / 2.0, 0.0
    for value, weight in pairs:
        running += weight
        if running >= half:
            return value
    return pairs[-1][0]


def fit_cost(samples, prior_slope: float | None = None, prior_weight: float = 4.0) -> tuple[float, float] | None:
    """(fixed, per_row) from (rows, ms) samples; None without two distinct row counts.

    Robust rather than least squares: one slow step (a scheduler hiccup, a garbage collection) must not
    teach the controller that rows are expensive. The one-row cost is the median time of the smallest
    blocks; the per-row cost is the median of the slopes from there to each larger block, weighted by
    how many rows larger it was (a 2-row step's noise would otherwise count as much as a 30-row step's
    signal), with an optional prior slope counted as `prior_weight` rows.
    """
    rows = [q for q, _ in samples]
    if len(set(rows)) < 2:
        return None
    base_q = min(rows)
    base_t = statistics.median(t for q, t in samples if q == base_q)
    slopes = [(t - base_t) / (q - base_q) for q, t in samples if q != base_q]
    weights = [float(q - base_q) for q, _ in samples if q != base_q]
    if prior_slope is not None:
        slopes.append(prior_slope)
        weights.append(prior_weight)
    per_row = max(weighted_median(slopes, weights), 0.0)
    return max(base_t - per_row * base_q, 0.0), per_row


def best_size(scores: list[float], fixed: float, per_row: float, single: float | None = None) -> int:
    """The n maximising (1 + sum(scores[:n])) / (fixed + per_row * (n + 1)); scores sorted descending.

    `single`, when given, is the measured time of a one-row step, which need not lie on the line: on a
    CPU a one-row step takes a matrix-vector path, and the second row costs far more than the tenth.
    """
    best_n, expected = 0, 1.0
    best_rate = 1.0 / (single if single is not None else fixed + per_row)
    for n, s in enumerate(scores, start=1):
        expected += s
        rate = expected / (fixed + per_row * (n + 1))
        if rate > best_rate:
            best_n, best_rate = n, rate
    return best_n


class HeadValue:
    """What drafting with a learned head is worth on one deployment, as discounted ratios: tokens only the
    head proposed accepted per drafting step, verification ms per emitted token, and the ms a drafting
    step adds (drafting, and verifying the rows only the head proposed). The priors try the head first;
    shared by a client's generations (through StepCosts), so a new one starts from what was measured."""

    def __init__(self, decay: float = 0.9):
        self._lock = threading.Lock()
        self.head_yield = Ratio(2.0, decay, prior_ratio=1.0)
        self.ms_per_token = Ratio(2.0, decay, prior_ratio=100.0)
        self.cost = Ratio(2.0, decay, prior_ratio=5.0)

    def pays(self) -> bool:
        with self._lock:
            return self.head_yield.value * self.ms_per_token.value > self.cost.value

    def observe_step(self, emitted: int, verify_ms: float) -> None:
        with self._lock:
            self.ms_per_token.update(emitted, verify_ms)

    def observe_drafting(self, head_tokens: int, cost_ms: float) -> None:
        with self._lock:
            self.head_yield.update(1.0, head_tokens)
            self.cost.update(1.0, cost_ms)


class StepCosts:
    """Recent (rows, ms) of verified steps on one deployment, and what a draft head is worth there;
    thread-safe, so generations may share it."""

    def __init__(self, window: int = ControllerConfig.window):
        self._lock = threading.Lock()
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)
        self.since_large = 0  # steps since the last block of at least explore_rows rows
        self.head = HeadValue()

    def add(self, rows: int, step_ms: float, explore_rows: int) -> None:
        with self._lock:
            self._samples.append((rows, step_ms))
            self.since_large = 0 if rows >= explore_rows else self.since_large + 1

    def samples(self) -> list[tuple[int, float]]:
        with self._lock:
            return list(self._samples)


class BlockController:
    def __init__(self, config: ControllerConfig = ControllerConfig(), costs: StepCosts | None = None):
        self.config = config
        self.costs = costs if costs is not None else StepCosts(config.window)
        self.residual = Ratio(
            config.calibration_prior, config.calibration_decay,
            floor=config.calibration_floor, cap=config.calibration_cap,
        )

    @property
    def calibration(self) -> float:
        """Accepted drafts per unit of (already per-node calibrated) path score sent."""
        return self.residual.value

    def cost(self) -> tuple[float, float]:
        """(fixed, per_row) of multi-row blocks."""
        samples = self.costs.samples()
        if samples:
            single = statistics.median(t for _, t in samples)
            multi = [(q, t) for q, t in samples if q > 1]
            fitted = fit_cost(multi, prior_slope=single * self.config.prior_per_row)
            if fitted is not None:
                return fitted
            return single, single * self.config.prior_per_row
        return 100.0, 5.0

    def single_step(self) -> float | None:
        """Median time of one-row steps, when there are any."""
        times = [t for q, t in self.costs.samples() if q == 1]
        return statistics.median(times) if times else None

    def block_ms(self, rows: int) -> float:
        """What a step verifying `rows` rows costs, from the fit (a one-row step: its own median, measured)."""
        single = self.single_step() if rows <= 1 else None
        if single is not None:
            return single
        fixed, per_row = self.cost()
        return fixed + per_row * max(rows, 1)

    def choose(self, scores: list[float], draft_ms_per_node: float = 0.0) -> int:
        """How many of the (descending) draft scores to send this step. `draft_ms_per_node`: what drafting
        cost per node this step (a learned head's time), priced with each row of the block."""
        calibrated = [min(s * self.calibration, 1.0) for s in scores[: self.config.max_nodes]]
        fixed, per_row = self.cost()
        per_row += draft_ms_per_node
        single = self.single_step()
        n = best_size(calibrated, fixed, per_row, single)
        # Small blocks alone cannot tell what a row costs (their noise is divided by one or two rows),
        # and an over-estimate would keep blocks small for ever: now and then, measure a large one, but
        # only when the answer matters: when each row past a one-row step costing what it measurably
        # costs were half as dear, a larger block would pay.
        base = single if single is not None else fixed + per_row
        if (
            self.costs.since_large >= self.config.explore_every
            and len(calibrated) >= self.config.explore_rows - 1
            and best_size(calibrated, base - per_row / 2, per_row / 2, single) > n
        ):
            n = max(n, self.config.explore_rows - 1)
        return n

    def observe(self, rows: int, step_ms: float, predicted: float, accepted_drafts: int) -> None:
        """A verified step: its rows and time, the sum of the path scores it sent and the drafts accepted."""
        self.costs.add(rows, step_ms, self.config.explore_rows)
        if predicted > 0:
            self.residual.update(predicted, accepted_drafts)
