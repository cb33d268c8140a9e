"""Synthetic T6 traffic for the metadata tests: traces whose sizes and times carry what the test says."""

from __future__ import annotations

import numpy as np

from splitinfer.privacy.traffic import Trace

ROW = 100
CATEGORIES = ("code", "prose", "chat")


def synthetic(prompt_id: str, category: str, accepted: list[int], padded: bool, rng) -> Trace:
    """Hello, one prompt chunk, then a decode step per accepted count: unpadded, a request's size says its rows
    and the previous step's keep list; padded, every request and reply is 5000 bytes. Times are noise."""
    t, messages = 0.0, []

    def exchange(up: int, down: int) -> None:
        nonlocal t
        t += rng.uniform(0.001, 0.002)
        messages.append(("up", t, up))
        t += rng.uniform(0.01, 0.02)
        messages.append(("down", t, down))

    exchange(200, 150)
    exchange(5000 if padded else 3000, 5000 if padded else 2900)
    keep = 0
    for a in accepted:
        rows = 1 + a
        exchange(5000 if padded else 300 + ROW * rows + 7 * keep, 5000 if padded else 250 + ROW * rows)
        keep = a
    t += 0.001
    messages.append(("up", t, 60))  # the close
    return Trace(prompt_id, category, tuple(messages), tuple(accepted), 1)


def traces(n: int, padded: bool, seed: int, prefix: str = "p") -> list[Trace]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        category = CATEGORIES[i % 3]
        mean = {"code": 3.0, "prose": 1.0, "chat": 0.3}[category] if not padded else 1.0
        steps = 20 if not padded else 12
        out.append(synthetic(f"{prefix}{i}", category, list(rng.poisson(mean, steps).clip(0, 6)), padded, rng))
    return out
