"""Per-step timings and bytes, and their summary.

A step's round trip is split the way the paper's breakdown is: `network` is the round trip minus the
time the server reports for handling the request (decode, compute, encode), `cloud_compute` is the
server's middle-layer time, `local_compute` is head + tail + norm + LM head + choosing tokens on the
client, `serialize` is the client's encode and decode of the two messages.

`step_summary` is the one summary of a generation's decode steps: the generation's own stats take its
medians, bench spec's runs its means (bench/runtime.py) and bench plain-split's the plain split's medians.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass


@dataclass
class StepRecord:
    kind: str  # "prefill" or "decode"; with blocks in flight "dropped" (its assumption failed) or "unused";
    # "cover" for a cover exchange (ClientConfig.pad_steps: a probe shaped like a step, no rows)
    rows: int  # block rows sent
    accepted: int  # tokens this step committed to the output (0 for prefill chunks)
    local_ms: float = 0.0
    serialize_ms: float = 0.0
    round_trip_ms: float = 0.0
    cloud_compute_ms: float = 0.0
    server_ms: float = 0.0
    bytes_up: int = 0
    bytes_down: int = 0
    recoveries: int = 0  # reconnects / re-prefills this step needed
    assumed: int = 0  # earlier blocks in flight this block was sent assuming accepted (0: sent after them)
    # With blocks in flight: the chance the controller gave what a block after this one assumed (or would have)
    # of it, and whether that held; None when there was no guess to assume.
    ahead_p: float | None = None
    ahead_held: bool | None = None

    @property
    def network_ms(self) -> float:
        return max(self.round_trip_ms - self.server_ms, 0.0)

    def as_dict(self) -> dict:
        return {**asdict(self), "network_ms": self.network_ms}


def median(values: list[float], digits: int = 4) -> float:
    """The median rounded to `digits`, 0.0 for no values: the one median the summaries and benchmarks use."""
    return round(statistics.median(values), digits) if values else 0.0


# The parts of a step, read from its record as StepRecord.as_dict writes it (a plain split's records, which
# carry no server time, have all but `network` and `server_other`).
STEP_PARTS: dict[str, Callable[[dict], float]] = {
    "round_trip": lambda s: s["round_trip_ms"],
    "network": lambda s: max(s["round_trip_ms"] - s["server_ms"], 0.0),
    "cloud_compute": lambda s: s["cloud_compute_ms"],
    "server_other": lambda s: max(s["server_ms"] - s["cloud_compute_ms"], 0.0),
    "local_compute": lambda s: s["local_ms"],
    "serialize": lambda s: s["serialize_ms"],
    "step": lambda s: s["round_trip_ms"] + s["local_ms"] + s["serialize_ms"],
    "bytes": lambda s: s["bytes_up"] + s["bytes_down"],
    "accepted": lambda s: s["accepted"],
}


def step_summary(steps: list[dict], parts: tuple[str, ...] = tuple(STEP_PARTS),
                 average: Callable[[list[float]], float] = median) -> dict[str, float]:
    """{part: `average` of it over the decode steps of `steps`} for each of `parts` (STEP_PARTS' names)."""
    decode = [s for s in steps if s["kind"] == "decode"]
    return {part: average([STEP_PARTS[part](s) for s in decode]) for part in parts}


def summarize(records: list[StepRecord], generated: int, decode_s: float, prefill_s: float) -> dict:
    """The `stats` object of a generation. Medians are over decode steps only."""
    decode = [r for r in records if r.kind == "decode"]
    accepted = [r.accepted for r in decode]
    parts = step_summary([asdict(r) for r in decode])
    # The first token comes out of prefill; the rate is of the tokens produced by decode steps.
    after_prefill = max(generated - 1, 0)
    return {
        "tokens_per_s": round(after_prefill / decode_s, 3) if decode_s > 0 and after_prefill else 0.0,
        "generated_tokens": generated,
        "steps": len(decode),
        "mean_accepted_per_step": round(sum(accepted) / len(accepted), 4) if accepted else 0.0,
        "max_accepted_per_step": max(accepted, default=0),
        "prefill_ms": round(prefill_s * 1e3, 3),
        "decode_s": round(decode_s, 4),
        "prefill_messages": sum(1 for r in records if r.kind == "prefill"),
        "cover_exchanges": sum(1 for r in records if r.kind == "cover"),
        "bytes_up": sum(r.bytes_up for r in records),
        "bytes_down": sum(r.bytes_down for r in records),
        "bytes_per_decode_step": parts["bytes"],
        "recoveries": sum(r.recoveries for r in records),
        "median_ms": {part: parts[part] for part in
                      ("round_trip", "network", "cloud_compute", "local_compute", "serialize", "step")},
    }
