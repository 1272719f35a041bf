"""The reward-hacking guard's signal, pure: the training reward rising while a judge falls over a window of
evaluations.

A run that games its reward (brighter and brighter until the picture is white) raises the reward on the evaluation
prompts while a judge that measures what the user wants (contrast, CLIP alignment) falls. Each series' change over
the window is the least-squares line's rise from the window's first evaluation to its last (slope x (n - 1)): it
reads the trend of every point, so one noisy evaluation moves it less than a first-to-last difference would, and a
straight line's change is exactly its first-to-last difference. The guard fires when the reward's change exceeds
``min_reward_rise`` and some judge's change is below ``-min_judge_drop``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Divergence:
    """Why the guard fired: the judge that fell, and both changes over the window."""

    judge: str
    reward_change: float
    judge_change: float
    window: int

    def described(self) -> str:
        return (
            f"over the last {self.window} evaluations the training reward rose by {self.reward_change:+.4g} while "
            f"judge {self.judge} changed by {self.judge_change:+.4g}"
        )


def fitted_change(values: Sequence[float]) -> float:
    """The least-squares line's change from the first point to the last: slope x (n - 1), points one apart."""
    count = len(values)
    if count < 2:
        raise ValueError(f"a change needs at least 2 values, got {count}")
    middle = (count - 1) / 2
    mean = sum(values) / count
    spread = sum((i - middle) ** 2 for i in range(count))
    slope = sum((i - middle) * (value - mean) for i, value in enumerate(values)) / spread
    return slope * (count - 1)


def divergence(
    rewards: Sequence[float],
    judges: Mapping[str, Sequence[float]],
    *,
    window: int,
    min_reward_rise: float,
    min_judge_drop: float,
) -> Divergence | None:
    """The divergence over the last ``window`` evaluations (``rewards[i]`` and each ``judges[name][i]`` come from the
    same evaluation), or None: too few evaluations yet, a value that is not finite in the window (nothing to read a
    trend from), the reward not rising by more than ``min_reward_rise``, or no judge falling by more than
    ``min_judge_drop``. Of several falling judges, the one that fell furthest."""
    if window < 2:
        raise ValueError(f"window must be >= 2, got {window}")
    if len(rewards) < window or not _finite(rewards[-window:]):
        return None
    reward_change = fitted_change(rewards[-window:])
    if not reward_change > min_reward_rise:
        return None
    falls = {
        name: fitted_change(values[-window:])
        for name, values in judges.items()
        if len(values) >= window and _finite(values[-window:])
    }
    falling = {name: change for name, change in falls.items() if change < -min_judge_drop}
    if not falling:
        return None
    judge = min(falling, key=lambda name: (falling[name], name))
    return Divergence(judge, reward_change, falling[judge], window)


def _finite(values: Sequence[float]) -> bool:
    return all(value is not None and math.isfinite(value) for value in values)
