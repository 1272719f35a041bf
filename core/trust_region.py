"""The dual trust region as pure logic: which KL terms a strategy uses and when the moving anchor refreshes.

``shared/spec/sage-grpo.md`` section 4. The anchor's weights themselves live in ``stages/anchor.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class KLStrategy(str, Enum):
    NONE = "none"  # no KL term
    FIXED = "fixed"  # position KL to the initial model
    STEP_WISE = "step_wise"  # velocity KL to the rollout policy only
    MOVING = "moving"  # position KL to a moving anchor only
    DUAL = "dual"  # moving-anchor position KL + step-wise velocity KL (SAGE-GRPO)


@dataclass(frozen=True)
class TrustRegion:
    """Weights of the two KL terms and the anchor refresh interval N (the reference code's N = 10)."""

    strategy: KLStrategy = KLStrategy.MOVING
    position_weight: float = 1.0
    stepwise_weight: float = 0.1
    anchor_interval: int = 10

    def __post_init__(self):
        object.__setattr__(self, "strategy", KLStrategy(self.strategy))
        if self.anchor_interval < 1:
            raise ValueError(f"anchor_interval must be >= 1, got {self.anchor_interval}")
        if self.position_weight < 0 or self.stepwise_weight < 0:
            raise ValueError("KL term weights must be >= 0")

    @property
    def uses_position_kl(self) -> bool:
        return self.strategy in (KLStrategy.FIXED, KLStrategy.MOVING, KLStrategy.DUAL)

    @property
    def uses_stepwise_kl(self) -> bool:
        return self.strategy in (KLStrategy.STEP_WISE, KLStrategy.DUAL)

    @property
    def needs_anchor(self) -> bool:
        return self.uses_position_kl

    @property
    def anchor_moves(self) -> bool:
        return self.strategy in (KLStrategy.MOVING, KLStrategy.DUAL)

    def refresh_due(self, updates_done: int) -> bool:
        """True when the anchor must be re-copied from the policy after ``updates_done`` optimizer updates.

        Counted in absolute updates (N, 2N, ...), so a run whose length N does not divide, or a resumed run,
        refreshes at the same updates as an uninterrupted one. A fixed anchor never refreshes.
        """
        return self.anchor_moves and updates_done > 0 and updates_done % self.anchor_interval == 0

    def total_kl(self, position_kl, stepwise_kl):
        """position_weight * position KL + stepwise_weight * step-wise KL, over the terms the strategy uses."""
        total = 0.0
        if self.uses_position_kl:
            total = total + self.position_weight * position_kl
        if self.uses_stepwise_kl:
            total = total + self.stepwise_weight * stepwise_kl
        return total
