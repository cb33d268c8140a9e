"""How many draft nodes to verify per round trip, decided from measurement.

A step that verifies q block rows costs t(q) milliseconds (round trip, local and cloud compute, bytes).
t is a measured curve, not a line: on a CPU it follows the kernels each row count takes (one row a
matrix-vector product; from four the packed matrix products of model/rows.py, which cost more at first and
flatten later), and on a GPU tens of rows cost about one. The curve is the median time of the
recent steps in each bucket of row counts, made non-decreasing, interpolated between buckets. A draft of
n nodes with calibrated acceptance probabilities s_1 >= s_2 >= ... commits 1 + s_1 + ... + s_n tokens in
expectation. The controller picks the n that maximises expected tokens per millisecond,
(1 + s_1 + ... + s_n) / t(n + 1); n = 0 is plain sequential decoding, chosen whenever speculation would
not pay (the break-even rule).

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
    window: int = 48  # recent steps the cost curve is measured from
    prior_step_ms: float = 100.0  # what a one-row step costs, until a step is measured
    prior_per_row: float = 0.05  # cost of a further row as a fraction of a one-row step, until measured
    calibration_decay: float = 0.97  # weight of history in the residual acceptance ratio
    calibration_prior: float = 8.0  # predicted drafts, at ratio 1, the residual starts from
    calibration_floor: float = 0.25  # never trust drafts less than this, so the controller keeps exploring
    calibration_cap: float = 4.0  # nor more than this
    explore_rows: int = 16  # block size of an exploration step, which measures what rows really cost
    explore_every: int = 24  # at most this many steps without a block that large


def row_bucket(rows: int) -> int:
    """The bucket a step of `rows` rows is measured in: 1, 2, 3, 4, then up to 6, 8, 12, 16, 24, 32, ..."""
    edge = 4
    while edge < rows:
        edge = edge * 3 // 2 if edge & (edge - 1) == 0 else edge * 4 // 3
    return max(rows, 1) if rows <= 4 else edge


def non_decreasing(values: list[float], weights: list[float]) -> list[float]:
    """The closest non-decreasing sequence in weighted least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [value, weight, count]
    for value, weight in zip(values, weights):
        blocks.append([value, weight, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, n2 = blocks.pop()
            v1, w1, n1 = blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return [value for value, _, count in blocks for _ in range(int(count))]


def cost_curve(samples) -> list[tuple[float, float]]:
    """(rows, ms) points from (rows, ms) samples: per bucket of row counts, the median rows and the median
    time, the times made non-decreasing in rows (a noisy bucket is pooled with its neighbours). Medians, so
    one slow step (a scheduler hiccup, a garbage collection) does not make rows look expensive."""
    buckets: dict[int, list[tuple[int, float]]] = {}
    for rows, ms in samples:
        buckets.setdefault(row_bucket(rows), []).append((rows, ms))
    keys = sorted(buckets)
    rows = [float(statistics.median(q for q, _ in buckets[k])) for k in keys]
    times = non_decreasing([statistics.median(t for _, t in buckets[k]) for k in keys], [len(buckets[k]) for k in keys])
    return list(zip(rows, times))


def curve_ms(points: list[tuple[float, float]], rows: int, prior_slope: float) -> float:
    """t(rows) on the curve: interpolated between its points; past the last, along the chord from the first
    point to the last (steeper than the last segment on a concave CPU curve, so unmeasured large blocks are
    not taken for cheap); below the first, along the first segment (with one point, `prior_slope`), but
    never under t0 x rows / r0 (the first point's cost per row: a step's cost per row does not grow as
    blocks shrink), so a noisy first segment cannot make a small step look free."""
    (r0, t0) = points[0]
    if rows <= r0:
        slope = prior_slope if len(points) == 1 else (points[1][1] - t0) / (points[1][0] - r0)
        return max(t0 - slope * (r0 - rows), t0 * rows / r0)
    if len(points) == 1:
        return t0 + prior_slope * (rows - r0)
    for (ra, ta), (rb, tb) in zip(points, points[1:]):
        if rows <= rb:
            return ta + (tb - ta) * (rows - ra) / (rb - ra)
    (rn, tn) = points[-1]
    return tn + (tn - t0) / (rn - r0) * (rows - rn)


def best_size(scores: list[float], costs: list[float]) -> int:
    """The n maximising (1 + sum(scores[:n])) / costs[n]; scores sorted descending, costs[q - 1] the time of
    a step of q rows (one row, and one per draft node), for q = 1 .. len(scores) + 1."""
    best_n, best_rate, expected = 0, 1.0 / max(costs[0], 1e-9), 1.0
    for n, s in enumerate(scores, start=1):
        expected += s
        rate = expected / max(costs[n], 1e-9)
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

    def curve(self) -> list[tuple[float, float]]:
        """The measured cost curve's (rows, ms) points; before any step, the prior's one-row point."""
        points = cost_curve(self.costs.samples())
        return points or [(1.0, self.config.prior_step_ms)]

    def block_ms(self, rows: int) -> float:
        """What a step verifying `rows` rows costs, on the measured curve."""
        points = self.curve()
        return curve_ms(points, max(rows, 1), self.config.prior_per_row * points[0][1])

    def choose(self, scores: list[float]) -> int:
        """How many of the (descending) draft scores to send this step."""
        calibrated = [min(s * self.calibration, 1.0) for s in scores[: self.config.max_nodes]]
        points = self.curve()
        slope = self.config.prior_per_row * points[0][1]
        costs = [curve_ms(points, q, slope) for q in range(1, len(calibrated) + 2)]
        n = best_size(calibrated, costs)
        # Past the largest block measured the curve is extrapolated, and an over-estimate there would keep
        # blocks small for ever: now and then, measure a large block, but only when the answer matters:
        # when, with every row past the first costing half what the curve says, a block larger than any
        # measured would pay.
        halved = [costs[0] + (c - costs[0]) / 2 for c in costs]
        wanted = best_size(calibrated, halved)
        if (
            self.costs.since_large >= self.config.explore_every
            and len(calibrated) >= self.config.explore_rows - 1
            and wanted > n
            and wanted + 1 > points[-1][0]
        ):
            n = max(n, self.config.explore_rows - 1)
        return n

    def observe(self, rows: int, step_ms: float, predicted: float, accepted_drafts: int) -> None:
        """A verified step: its rows and time, the sum of the path scores it sent and the drafts accepted."""
        self.costs.add(rows, step_ms, self.config.explore_rows)
        if predicted > 0:
            self.residual.update(predicted, accepted_drafts)
