"""Learning-rate schedules as pure functions of the optimizer step: a linear warm-up, then constant, linear or
cosine decay to ``min_ratio`` of the base rate over ``decay_steps`` (the usual shapes of transformers' schedulers)."""

from __future__ import annotations

import math
from typing import Literal

LRSchedule = Literal["constant", "linear", "cosine"]


def lr_multiplier(
    step: int,
    *,
    schedule: LRSchedule = "constant",
    warmup_steps: int = 0,
    decay_steps: int | None = None,
    min_ratio: float = 0.0,
) -> float:
    """The factor on the base learning rate at optimizer step ``step`` (0 for the first step)."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant" or not decay_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    shape = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * shape
