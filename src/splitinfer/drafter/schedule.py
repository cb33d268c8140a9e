"""The learning rate of `drafter train` at each step, and the checkpoint a run may resume from.

Two schedules (`--schedule`):
  wsd     warm-up over `warmup_steps`, then the peak rate held, then a cosine down to a tenth of it over the
          last `decay_share` of `steps` (warm-up, stable, decay). No rate before the decay depends on `steps`,
          so a run extended with a larger --steps resumes from its last checkpoint taken before the decay
          began (checkpoint-stable.pt) and ends with exactly the head a run made with the larger --steps
          from the start ends with. This is what lets a head be trained in several sessions.
  cosine  warm-up over steps // 20, then a cosine to a tenth at `steps` (the shipped head's recipe). Every
          rate after the warm-up depends on `steps`, so a resume must keep --steps.

A checkpoint is resumed from only when every rate used before it equals this run's (`same_until`); else the
run stops with an error that says which --steps would resume it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..errors import ConfigError

SCHEDULES = ("wsd", "cosine")
CHECKPOINT = "checkpoint.pt"  # the last checkpoint
STABLE = "checkpoint-stable.pt"  # the last checkpoint before the decay began (what an extended run resumes from)
FLOOR = 0.1  # both schedules end at this share of the peak rate


@dataclass(frozen=True)
class Schedule:
    kind: str
    steps: int
    lr: float
    warmup_steps: int  # wsd only; cosine warms up over steps // 20
    decay_share: float  # wsd only: the share of steps the decay takes

    def __post_init__(self):
        if self.kind not in SCHEDULES:
            raise ConfigError(f"--schedule must be one of {', '.join(SCHEDULES)}, not {self.kind!r}.")
        if not 0.0 < self.decay_share <= 1.0 or self.warmup_steps < 0:
            raise ConfigError(f"--decay-share must be in (0, 1] and --warmup-steps >= 0; got {self.decay_share}, "
                              f"{self.warmup_steps}.")
        if self.kind == "wsd" and self.steps and self.warmup_steps > self.steps * (1 - self.decay_share):
            raise ConfigError(f"--warmup-steps {self.warmup_steps} leaves --schedule wsd no steps at the peak rate "
                              f"in --steps {self.steps}; give fewer warm-up steps or more steps.")

    @classmethod
    def of(cls, config) -> Schedule:
        """The schedule of a TrainConfig."""
        return cls(config.schedule, config.steps, config.lr, config.warmup_steps, config.decay_share)

    def warmup(self) -> int:
        return max(1, self.steps // 20) if self.kind == "cosine" else max(1, self.warmup_steps)

    def decay_start(self) -> int:
        """The first step whose rate depends on `steps`."""
        if self.kind == "cosine":
            return self.warmup()
        return max(self.warmup(), self.steps - round(self.decay_share * self.steps))

    def rate(self, step: int) -> float:
        """The learning rate of training step `step` (0-based)."""
        if step < self.warmup():
            return self.lr * (step + 1) / self.warmup()
        start = self.decay_start()
        if step < start:
            return self.lr
        # written as train.py wrote it before the schedules, so cosine repeats the shipped head's rates bit for bit
        angle = math.pi * (min(step, self.steps) - start) / max(1, self.steps - start)
        return self.lr * (FLOOR + (1 - FLOOR) * 0.5 * (1 + math.cos(angle)))


def same_until(a: Schedule, b: Schedule, step: int) -> bool:
    """True when steps 0 .. step - 1 ran at the same rates under `a` as under `b`."""
    return all(a.rate(i) == b.rate(i) for i in range(step))


def resume(out: Path, schedule: Schedule) -> dict | None:
    """The saved training state this run continues from: the last checkpoint, else the last one before its
    decay, whichever used this run's rates so far; None when `out` holds neither; ConfigError when it holds
    checkpoints of another schedule only."""
    refused = []
    for name in (CHECKPOINT, STABLE):
        if not (out / name).exists():
            continue
        saved = torch.load(out / name, weights_only=False)
        before = saved.get("schedule")  # absent in checkpoints from before the schedules: resumed as they are
        if before is None or same_until(Schedule(**before), schedule, saved["step"]):
            return saved
        refused.append(f"{name} at step {saved['step']} (--schedule {before['kind']} --steps {before['steps']})")
    if refused:
        raise ConfigError(f"{out} holds {' and '.join(refused)}, trained at other learning rates than this run's "
                          "before that step; resume with the --steps it was made with, or use a new --out (with "
                          "--schedule wsd a longer run resumes from its last checkpoint before the decay).")
    return None


def save(out: Path, payload: dict, schedule: Schedule) -> None:
    """Write the checkpoint (atomically), and keep it as the stable one while the decay has not begun."""
    payload = payload | {"schedule": asdict(schedule)}
    for name in (CHECKPOINT, STABLE) if payload["step"] <= schedule.decay_start() else (CHECKPOINT,):
        tmp = (out / name).with_suffix(".tmp")
        torch.save(payload, tmp)
        tmp.replace(out / name)
