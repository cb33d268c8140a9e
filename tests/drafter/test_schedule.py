"""The learning-rate schedules of `drafter train` (resuming with them: tests/drafter/test_train.py)."""

from __future__ import annotations

import math

import pytest

from splitinfer.drafter.schedule import Schedule, same_until
from splitinfer.errors import ConfigError


def _old_cosine(lr: float, steps: int, step: int) -> float:
    # the schedule every head before `--schedule` was trained with (train.py's `_lr` until then)
    warmup = max(1, steps // 20)
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))


def test_cosine_is_the_schedule_the_shipped_head_was_trained_with():
    for steps in (4, 100, 4800):
        s = Schedule("cosine", steps, 1.5e-3, 240, 0.2)
        assert all(s.rate(i) == _old_cosine(1.5e-3, steps, i) for i in range(steps))


def test_wsd_rates_before_the_decay_do_not_depend_on_steps():
    short, long = Schedule("wsd", 1000, 1e-3, 50, 0.2), Schedule("wsd", 5000, 1e-3, 50, 0.2)
    assert short.decay_start() == 800 and long.decay_start() == 4000
    assert short.rate(0) == pytest.approx(1e-3 / 50) and short.rate(49) == short.rate(799) == 1e-3
    assert short.rate(999) == pytest.approx(1e-4, rel=0.01) and short.rate(900) < short.rate(850) < 1e-3
    assert same_until(short, long, 801) and not same_until(short, long, 802)  # step 800 is the decay at its peak
    cosine = (Schedule("cosine", 1000, 1e-3, 50, 0.2), Schedule("cosine", 5000, 1e-3, 50, 0.2))
    assert not same_until(*cosine, 2)  # the warm-up itself depends on steps
    with pytest.raises(ConfigError, match="--schedule"):
        Schedule("linear", 10, 1e-3, 1, 0.2)
    with pytest.raises(ConfigError, match="--decay-share"):
        Schedule("wsd", 10, 1e-3, 1, 0.0)
    with pytest.raises(ConfigError, match="--warmup-steps 240 leaves"):
        Schedule("wsd", 100, 1e-3, 240, 0.2)
    Schedule("wsd", 0, 1e-3, 240, 0.2)  # --steps 0 makes the data only
    assert Schedule("cosine", 100, 1e-3, 240, 0.2).warmup() == 5  # cosine's own warm-up: steps // 20
