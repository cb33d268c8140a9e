"""Cover exchanges at the end of a reply (threat T6): the step count a reply took does not show on the wire.

`pad_exchanges` sends cover exchanges (wire/cover.py) until a reply's decode exchanges are a multiple of
`ClientConfig.pad_steps`, each shaped like the reply's own steps (sizes, server hold, client think time).
Row padding of every message is the link's (wire/padding.py); pacing sends is the link driver's.
It knows nothing about tokens or caches: output is unchanged by it.
"""

from __future__ import annotations

import logging

import numpy as np

from ..errors import TransportError
from ..telemetry import StepRecord
from .config import ClientConfig
from .driver import LinkDriver

log = logging.getLogger("splitinfer.local")


def pad_exchanges(records: list[StepRecord], first_record: int, config: ClientConfig, driver: LinkDriver) -> int:
    """Send cover exchanges until the exchanges since record `first_record`, prompt chunks aside, are a
    multiple of `config.pad_steps`; returns how many were sent (their records are appended to `records`).
    Each has the sizes most of those steps had and is held by the server for `pad_hold_ms` (else their
    median pass); it follows the last reply by `pad_think_ms` (else their median local time), so on the
    wire it looks like one more step. Best effort: a lost link ends the padding (logged)."""
    steps = [r for r in records[first_record:] if r.kind != "prefill"]
    missing = -len(steps) % config.pad_steps if config.pad_steps and steps else 0
    if not missing:
        return 0
    up, down = _most_common([(r.bytes_up, r.bytes_down) for r in steps])
    hold = config.pad_hold_ms or float(np.median([r.server_ms for r in steps]))
    think = 0.0 if config.pad_think_ms else float(np.median([r.local_ms for r in steps]))
    for sent in range(missing):
        driver.sleep(think / 1e3)
        driver.pace()
        t0 = driver.clock()
        try:
            driver.middle.cover(up, down, hold)
        except TransportError as exc:
            log.warning("cover exchanges stopped after %d of %d: %s", sent, missing, exc)
            return sent
        driver.replied_at = driver.clock()
        records.append(StepRecord("cover", 0, 0, local_ms=think, round_trip_ms=(driver.replied_at - t0) * 1e3,
                                  server_ms=hold, bytes_up=up, bytes_down=down))
    return missing


def _most_common(values: list):
    """The value seen most often (the first seen among ties)."""
    return max(dict.fromkeys(values), key=values.count)
