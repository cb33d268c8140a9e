"""Whether the next block goes out ahead, before the blocks in flight are resolved, from measured costs.

A block sent ahead assumes the most likely outcome of the blocks still in flight and carries several
candidates for the token chosen after them (loop.py, roots.py). With probability p that assumption
holds (the rows kept are the ones assumed and the token chosen is one of its roots) and the block's
result comes back sooner than if it had waited; with probability 1 - p it is dropped, and what it cost
delays the next valid block. The rule
(`worth_sending`, a pure function) sends it when

    p * saving(d)  >  (1 - p) * (the part of its cloud pass ahead of the next valid block
                                 + the client's time to make it)

where d is the block's depth (how many blocks would then be in flight, itself included). The saving
follows the pipelining model tok/s = 1000 a / ((1 - p) L + p max(t, L / D)): one block at a time takes
P = latency + client time per block, d blocks in flight take max(t, P / d) per block, t the busiest
stage (the client or the cloud), so the block at depth d saves max(t, P / (d - 1)) - max(t, P / d).

A dropped block delays the next valid one by what is left of its cloud pass when that one arrives. The
cloud runs a connection's steps in order, from the oldest block in flight: the block at depth d runs
from (d - 1) c to d c (c one pass), and the next valid block, sent once the client has the oldest's
result and has made it, arrives at T = latency + client time. A pass not started by then is skipped
(the server sees the client dropped it, cloud/inbox.py), one finished by then cost nothing, and one
running costs d c - T. The client's time making the dropped block is charged in full: on paper it
overlaps the wait for a result, but on a machine shared with other work it is not free. So a CPU cloud
whose pass is longer than the round trip plus the client's time (low RTT) rarely sends ahead, a long
round trip hides most of a dropped pass and sends the likelier blocks, and a fast cloud behind a long
round trip sends ahead when p is moderate.

`AheadController` keeps the running estimates (exponential moving averages) the rule reads: the
latency of a block sent alone (send to result, the tail excluded), the cloud's compute per block
(Result.compute_ms), the client's own time per block (draft, head, tail, acceptance) and the share of it
spent making a block (draft and head; its extra rows included). p is the calibrated chance of the rows
assumed kept times the candidate roots' summed scores, times a ratio learned from how often the
assumption held: every resolved block checks the assumption the next block would have made, sent ahead
or not, so the ratio learns even while nothing goes ahead.

It knows nothing of the network, the model or the strategies: numbers in, a decision out.
"""

from __future__ import annotations

from dataclasses import dataclass

from .calibration import Ratio

MAX_DEPTH = 3  # blocks in flight at once at most; deeper chains of assumptions rarely hold


@dataclass(frozen=True)
class AheadConfig:
    decay: float = 0.8  # weight of history in each running estimate; 0.8 follows a change within ~5 blocks
    min_samples: int = 2  # blocks measured alone before any block goes ahead
    hold_prior: float = 2.0  # assumptions, at ratio 1, the hold-rate ratio starts from
    hold_decay: float = 0.95  # weight of history in the hold-rate ratio
    hold_floor: float = 0.05  # never trust an assumption less than this share of its score (keeps learning)
    hold_cap: float = 3.0  # nor more than this multiple
    # A block sent ahead carries several candidate roots for the token chosen before it (decoding/roots.py):
    max_roots: int = 4  # at most this many; each costs the client and the cloud one row, plus its draft's
    root_floor: float = 0.02  # a candidate less likely than this (calibrated) is not worth its rows
    root_nodes: int = 2  # predicted draft nodes below each candidate but the likeliest (which gets a full draft)
    root_candidates: int = 48  # nodes of the strategy's prediction the candidates and their drafts come from
    kept_tries: int = 3  # prefixes of a draft's top path weighed as the rows kept (a prediction each)

    def __post_init__(self):
        if not (0 <= self.decay < 1 and 0 < self.hold_decay <= 1 and self.min_samples >= 1 and self.hold_prior > 0):
            raise ValueError("ahead decays must lie in [0, 1), hold decay in (0, 1], samples and prior positive.")
        if not (1 <= self.max_roots <= self.root_candidates and self.root_nodes >= 0 and 0 <= self.root_floor < 1
                and self.kept_tries >= 1):
            raise ValueError("max_roots must lie in [1, root_candidates], root_nodes >= 0, root_floor in [0, 1), "
                             "kept_tries >= 1.")


@dataclass(frozen=True)
class Costs:
    """What one block costs, in ms, as measured."""

    latency_ms: float  # a block sent alone: sent -> result back (round trip and cloud compute; the tail excluded)
    cloud_ms: float  # the cloud's compute per block
    client_ms: float  # the client's own time per block: draft, head, tail, acceptance
    make_ms: float  # of client_ms, making a block: draft and head (what a dropped block cost the client)


def saving_ms(depth: int, costs: Costs) -> float:
    """Time per block saved by the block at `depth` (2 or more) when its assumption holds."""
    assert depth >= 2, depth
    period = costs.latency_ms + costs.client_ms  # one block at a time
    busiest = max(costs.client_ms, costs.cloud_ms)
    return max(busiest, period / (depth - 1)) - max(busiest, period / depth)


def drop_cost_ms(depth: int, costs: Costs) -> float:
    """What the block at `depth`, dropped, costs the next valid one: what is left of its cloud pass when that
    block arrives (none if the pass was skipped or over by then), and its making."""
    arrives = costs.latency_ms + costs.client_ms  # after the oldest block's pass began
    c = costs.cloud_ms
    running = 0.0 if (depth - 1) * c > arrives else min(max(depth * c - arrives, 0.0), c)
    return running + costs.make_ms


def worth_sending(p: float, depth: int, costs: Costs) -> bool:
    """Send the block at `depth` ahead, its assumption holding with probability p?"""
    return p * saving_ms(depth, costs) > (1.0 - p) * drop_cost_ms(depth, costs)


class _Mean:
    """An exponential moving average that starts at its first sample."""

    def __init__(self, decay: float):
        self.decay, self.value, self.samples = decay, 0.0, 0

    def add(self, x: float) -> None:
        self.value = x if self.samples == 0 else self.decay * self.value + (1 - self.decay) * x
        self.samples += 1


class AheadController:
    """Running cost estimates and the assumption's hold rate of one generation; decides each block ahead."""

    def __init__(self, config: AheadConfig = AheadConfig()):
        self.config = config
        self._latency, self._cloud, self._client, self._make = (_Mean(config.decay) for _ in range(4))
        self._hold = Ratio(config.hold_prior, config.hold_decay, floor=config.hold_floor, cap=config.hold_cap)
        self.assumptions = 0  # assumptions checked against what the block resolved to
        self.held = 0  # of them, those that held

    def costs(self) -> Costs | None:
        """The current estimates; None until enough blocks were measured alone."""
        if self._latency.samples < self.config.min_samples:
            return None
        return Costs(self._latency.value, self._cloud.value, self._client.value, self._make.value)

    def p(self, score: float) -> float:
        """The chance an assumption holds, from its calibrated score and the measured hold rate."""
        return min(score * self._hold.value, 1.0)

    def worth(self, p: float, depth: int) -> bool:
        costs = self.costs()
        return costs is not None and worth_sending(p, depth, costs)

    def observe_block(self, cloud_ms: float, client_ms: float, make_ms: float, latency_ms: float | None) -> None:
        """A resolved block's costs; latency_ms only for a block sent alone and waited for at once."""
        self._cloud.add(cloud_ms)
        self._client.add(client_ms)
        self._make.add(make_ms)
        if latency_ms is not None:
            self._latency.add(latency_ms)

    def observe_assumption(self, score: float, held: bool) -> None:
        """The assumption a block after this one would make (score: its calibrated score) held or not."""
        self._hold.update(score, float(held))
        self.assumptions += 1
        self.held += held
