"""How far to trust the probabilities a draft is built from, learned online from what verification accepted.

One estimator, `Ratio`: accepted / predicted, both discounted sums that start from a prior. It is used
at two layers, and the second multiplies the first:

1. A draft node (`NodeCalibration`, keyed by what predicted the node). A node's conditional probability
   given that its parent is accepted is `base x ratio[key]`, where `base` is the source's own number:
     - ("suffix", L): a copy that has matched L tokens goes on one more; base is the prior L / (L + 2),
       and the share of earlier occurrences that went on with this token multiplies on top (it is
       counted, not learned). One ratio per L up to `copy_cap`, longer copies share the last.
     - ("recycling", p): Token Recycling; base is p, the successor probability read from a logits row
       of another context (the key carries it, so the evidence is the number the source gave).
   The evidence is every verified node whose parent was accepted (only those were tested):
   predicted += base, accepted += 1 if the node was accepted. A path's score is the product of its
   nodes' calibrated probabilities (TokenTrie.add_path); these scores decide which nodes a draft holds.
2. The block (`BlockController`, one `Ratio`): the expected number of accepted drafts is
   residual x (the sum of the path scores sent); this decides how many nodes to send. The evidence is
   each step's sum of path scores as sent against the drafts accepted.

Why nothing is counted twice: each ratio learns against a prediction that holds every factor below it
and none of its own. Layer 1 learns against `base`, so a node's weight never feeds back into the
evidence that set it. The residual learns against scores that already carry layer 1's ratios, so where
those are right it sees only what a per-node estimate cannot: one source's score standing for a node
several sources proposed, and the spread of conditional probabilities between texts, which a product
of averages does not reproduce. A draft whose layer-1 ratios are right keeps the residual at 1. While a
source's accuracy is changing both layers see the change (layer 1 has not caught up yet); the residual
forgets that within a few dozen steps (`ControllerConfig.calibration_decay`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class Ratio:
    """Discounted accepted / predicted, starting from `prior` predicted units at ratio `prior_ratio`.

    Every update first multiplies both sums by `decay` (1.0 forgets nothing); the estimate is kept in
    [floor, cap], so a bad start cannot drive it to zero and stop the drafts that would revise it.
    """

    def __init__(self, prior: float, decay: float, prior_ratio: float = 1.0, floor: float = 0.0, cap: float = math.inf):
        self.decay, self.floor, self.cap = decay, floor, cap
        self.predicted = prior
        self.accepted = prior * prior_ratio

    @property
    def value(self) -> float:
        return min(max(self.accepted / self.predicted, self.floor), self.cap)

    def update(self, predicted: float, accepted: float) -> None:
        self.predicted = self.decay * self.predicted + predicted
        self.accepted = self.decay * self.accepted + accepted


def prior_continue_prob(length: int) -> float:
    """Before anything is measured: a copy that has matched L tokens goes on with probability L / (L + 2)."""
    return length / (length + 2.0)


@dataclass(frozen=True)
class CalibrationConfig:
    copy_cap: int = 16  # match lengths with their own copy estimate; longer ones share the last
    copy_prior: float = 4.0  # prior observations of each copy estimate (at the prior L / (L + 2))
    copy_decay: float = 0.99
    recycling_prior: float = 2.0  # prior predicted units of the Token Recycling ratio (at ratio 1)
    recycling_decay: float = 0.98
    recycling_floor: float = 0.05
    recycling_cap: float = 2.0  # above 1: a source may be too modest; path steps are capped in TokenTrie


class NodeCalibration:
    """Layer 1: the per-node ratios of every source, keyed as the sources key their draft nodes."""

    def __init__(self, config: CalibrationConfig = CalibrationConfig()):
        self.config = config
        self._copy = [
            Ratio(config.copy_prior * prior_continue_prob(length), config.copy_decay)
            for length in range(1, config.copy_cap + 1)
        ]
        self._recycling = Ratio(
            config.recycling_prior, config.recycling_decay, floor=config.recycling_floor, cap=config.recycling_cap
        )

    def _copy_length(self, length: int) -> int:
        return min(max(length, 1), self.config.copy_cap)

    def continue_prob(self, length: int) -> float:
        """P(a copy that has matched `length` tokens goes on one more)."""
        length = self._copy_length(length)
        return prior_continue_prob(length) * self._copy[length - 1].value

    @property
    def recycling_weight(self) -> float:
        """The factor on Token Recycling's successor probabilities."""
        return self._recycling.value

    def _estimate(self, key: tuple) -> tuple[Ratio, float]:
        """The ratio a node's key names and the base it multiplied."""
        if key[0] == "suffix":
            length = self._copy_length(key[1])
            return self._copy[length - 1], prior_continue_prob(length)
        assert key[0] == "recycling", key
        return self._recycling, key[1]

    def observe(self, keys: list, parents: list[int], accepted_rows: set[int]) -> None:
        """Learn from a verified draft: node i (block row i + 1) was tested if its parent row was accepted.

        Each copy length learns once per tested node; Token Recycling learns once per block from the sum
        over its tested nodes, so its forgetting is counted in blocks, not in nodes.
        """
        recycling_predicted = recycling_accepted = 0.0
        for i, (key, parent) in enumerate(zip(keys, parents)):
            if key is None or parent not in accepted_rows:
                continue
            ratio, base = self._estimate(key)
            hit = float((i + 1) in accepted_rows)
            if ratio is self._recycling:
                recycling_predicted += base
                recycling_accepted += hit
            else:
                ratio.update(base, hit)
        if recycling_predicted > 0:
            self._recycling.update(recycling_predicted, recycling_accepted)
